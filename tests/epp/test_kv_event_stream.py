"""KV events decoded from vLLM's wire format, and applied in order through gaps, replays and restarts."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from epp.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventStream,
    KVEvent,
    KVEventDecodeError,
    decode_batch,
)
from epp.kvcache.precise_index import PreciseIndex
from sim.kv_events import encode_batch

# As vLLM 0.32 publishes them (tests/fixtures/vllm-0.32/kv_events_sample.txt).
STORED = {
    "type": "BlockStored",
    "block_hashes": [612586660634552375, 2**64 - 1],
    "parent_block_hash": None,
    "token_ids": list(range(64)),
    "block_size": 32,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0}
CLEARED = {"type": "AllBlocksCleared"}
ENDPOINT = "e"


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_decodes_the_simulators_vllm_batches() -> None:
    extended = {**STORED, "block_hashes": [5], "parent_block_hash": 2**64 - 1, "extra_keys": [None]}
    batch = decode_batch(seq(7), encode_batch(1.5, [STORED, extended, REMOVED, CLEARED]))
    assert batch == EventBatch(
        7,
        1.5,
        (
            BlockStored((612586660634552375, 2**64 - 1), None, "GPU"),
            BlockStored((5,), 2**64 - 1, "GPU"),
            BlockRemoved((2**64 - 1,), "GPU"),
            AllBlocksCleared(),
        ),
    )


def test_digest_hashes_reduce_to_their_low_64_bits_and_unknown_events_are_counted() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb(
        [0.0, [{**STORED, "block_hashes": [digest], "parent_block_hash": digest}, {"type": "Other"}], 0]
    )
    (event,) = decode_batch(seq(0), payload).events
    low = int.from_bytes(digest[-8:], "big")
    assert event == BlockStored((low,), low, "GPU")
    assert decode_batch(seq(0), payload).unknown == 1


@pytest.mark.parametrize(
    ("seq_frame", "payload"),
    [
        (b"\x00", encode_batch(0.0, [CLEARED])),
        (seq(0), b"\xc1"),
        (seq(0), msgpack.packb({"ts": 0})),
        (seq(0), msgpack.packb([0.0, ["BlockStored"], 0])),
        (seq(0), msgpack.packb([0.0, [{"type": "BlockRemoved"}], 0])),
        (seq(0), msgpack.packb([0.0, [{**STORED, "block_hashes": [-1]}], 0])),
    ],
)
def test_malformed_batches_are_rejected(seq_frame: bytes, payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(seq_frame, payload)


def test_blocks_on_other_media_are_not_indexed() -> None:
    index = PreciseIndex()
    index.add_endpoint(ENDPOINT)
    stream = EventStream(index, ENDPOINT)
    stream.accept(EventBatch(0, 0.0, (BlockStored((1, 2), None, "GPU"), BlockStored((3,), None, "CPU"))))
    stream.accept(EventBatch(1, 0.0, (BlockRemoved((2,), "CPU"),)))
    assert index.longest_prefix([1, 2, 3]) == {ENDPOINT: 2}


def test_a_restarted_publisher_starts_the_endpoint_over() -> None:
    index = PreciseIndex()
    index.add_endpoint(ENDPOINT)
    stream = EventStream(index, ENDPOINT)
    for n in range(3):
        assert stream.accept(EventBatch(n, 0.0, (BlockStored((n + 1,), n or None),))) is None
    assert stream.accept(EventBatch(0, 0.0, (BlockStored((9,), None),))) is None
    assert stream.restarts == 1
    assert index.blocks_held(ENDPOINT) == 1 and index.holds(ENDPOINT, 9)


# ---------------------------------------------------------------- gaps, replays, property-based

HASHES = st.integers(0, 15)
STORES = st.builds(lambda h: BlockStored(tuple(h), None), st.lists(HASHES, min_size=1, max_size=4))
REMOVALS = st.builds(lambda h: BlockRemoved(tuple(h)), st.lists(HASHES, min_size=1, max_size=4))
EVENT = st.one_of(STORES, REMOVALS, STORES, REMOVALS, st.just(AllBlocksCleared()))


def truth(history: Sequence[Sequence[KVEvent]]) -> set[int]:
    held: set[int] = set()
    for events in history:
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
    return held


LOST_REMOVAL = [
    ([BlockStored((1,), None)], False),
    ([BlockRemoved((1,))], True),  # missed, and gone from the replay buffer by the time it is asked
    ([BlockStored((2,), None)], True),
    ([BlockStored((3,), None)], False),
]


@settings(max_examples=500, deadline=None)
@given(
    history=st.lists(
        st.tuples(st.lists(EVENT, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=25
    ),
    buffer_steps=st.integers(0, 10),
    catch_up=st.booleans(),
)
@example(history=LOST_REMOVAL, buffer_steps=2, catch_up=False)
def test_gaps_are_replayed_or_the_endpoint_rebuilt_never_left_wrong(
    history: list[tuple[list[KVEvent], bool]], buffer_steps: int, catch_up: bool
) -> None:
    """A publisher with a replay buffer of ``buffer_steps`` batches; the subscriber misses the
    batches flagged True (and, unless it catches up first, joins after batch 0 was sent)."""
    batches = [EventBatch(n, float(n), tuple(events)) for n, (events, _) in enumerate(history)]
    delivered = [b for b, (_, dropped) in zip(batches, history, strict=True) if not dropped]
    if not delivered:
        return

    def replay(start: int, published: int) -> list[EventBatch]:
        return [b for b in batches[max(0, published - buffer_steps) : published] if b.seq >= start]

    index = PreciseIndex()
    index.add_endpoint(ENDPOINT)
    stream = EventStream(index, ENDPOINT)
    exact = True
    if catch_up:
        # Replay first, at a moment when the first delivered batch was already published.
        before = replay(0, delivered[0].seq + 1)
        stream.catch_up(before)
        exact = (bool(before) and before[0].seq == 0) or (delivered[0].seq == 0 and not before)
    for batch in delivered:
        start = stream.accept(batch)
        if start is not None:
            exact &= stream.recover(replay(start, batch.seq + 1), batch)
        held = {h for h in range(16) if index.holds(ENDPOINT, h)}
        expected = truth([events for events, _ in history[: batch.seq + 1]])
        assert held <= expected  # never a block the engine does not hold
        if exact:
            assert held == expected
        assert index.blocks_held(ENDPOINT) == len(held)
