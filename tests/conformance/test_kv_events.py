"""KV events on the wire: framing, seq numbers, event fields, hash chaining, clears and evictions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from epp.kvcache.block_hash import chain_hashes, external_hash
from sim.real_vllm import BLOCK_SIZE
from tests.kv_event_subscriber import Batch

from .conftest import Served, on_each, random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

BLOCK_STORED_FIELDS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
]  # fmt: skip
BLOCK_REMOVED_FIELDS = ["type", "block_hashes", "medium", "group_idx"]
# 511 usable blocks of 32 tokens; a 1,900-token prompt plus its output token takes 60.
EVICTING_PROMPT_TOKENS = 1900
MAX_EVICTING_PROMPTS = 12


def stores_last_block(tokens: list[int]) -> Callable[[Batch], bool]:
    """A predicate on batches: does it store the last full block of ``tokens``? (Recognised by its
    token ids, so that a wrong hash fails an assertion rather than this wait.)"""
    end = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    last = tokens[end - BLOCK_SIZE : end]

    def stores(batch: Batch) -> bool:
        return any(event["token_ids"][-BLOCK_SIZE:] == last for event in batch.of_type("BlockStored"))

    return stores


def complete_and_collect(engine: Served, prompt: list[int], **fields: Any) -> list[Batch]:
    """Complete ``prompt`` (one token) and return the batches up to the one storing its last block."""
    engine.events.pending()
    engine.complete(prompt, **fields)
    return engine.events.until(stores_last_block(prompt))


def events(batches: list[Batch]) -> list[dict[str, Any]]:
    return [event for batch in batches for event in batch.events]


def test_batches_are_framed_like_vllms(engine: Served) -> None:
    engine.reset_prefix_cache()
    batches = [
        batch
        for seed in (10, 11, 12)
        for batch in complete_and_collect(engine, random_prompt(3 * BLOCK_SIZE + 5, seed))
    ]
    # Decoding already checked three frames, an 8-byte seq and msgpack [ts, events, rank].
    assert {(batch.topic, batch.data_parallel_rank) for batch in batches} == {(b"", 0)}
    seqs = [batch.seq for batch in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(batch.events for batch in batches)


def test_block_stored_names_the_prompts_blocks_and_chains_them(engines: dict[str, Served]) -> None:
    prompt = random_prompt(3 * BLOCK_SIZE + 4, seed=20)
    extended = prompt[: 3 * BLOCK_SIZE] + random_prompt(2 * BLOCK_SIZE + 6, seed=21)
    salted = [*random_prompt(2 * BLOCK_SIZE, seed=22), 7]

    def store(engine: Served) -> list[list[dict[str, Any]]]:
        engine.reset_prefix_cache()
        return [
            events(complete_and_collect(engine, prompt)),
            events(complete_and_collect(engine, extended)),
            events(complete_and_collect(engine, salted, cache_salt="tenant-a")),
        ]

    stored = on_each(engines, store)
    assert stored["sim"] == stored["vllm"]  # the same events, hashes included

    # The reset before is published with the first step after it.
    (cleared, first), (second,), (third,) = stored["sim"]
    assert cleared == {"type": "AllBlocksCleared"}
    assert list(first) == BLOCK_STORED_FIELDS
    hashes = [external_hash(digest) for digest in chain_hashes(prompt, BLOCK_SIZE)]
    assert first == {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": prompt[: 3 * BLOCK_SIZE],
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert all(isinstance(value, int) and 0 <= value < 2**64 for value in hashes)
    # The extension stores only its new blocks, chained to the last cached one.
    extended_hashes = [external_hash(digest) for digest in chain_hashes(extended, BLOCK_SIZE)]
    assert extended_hashes[:3] == hashes
    assert (second["block_hashes"], second["parent_block_hash"]) == (extended_hashes[3:], hashes[-1])
    assert second["token_ids"] == extended[3 * BLOCK_SIZE : 5 * BLOCK_SIZE]
    # A cache salt keys the first block only.
    salted_hashes = chain_hashes(salted, BLOCK_SIZE, cache_salt="tenant-a")
    assert third["block_hashes"] == [external_hash(digest) for digest in salted_hashes]
    assert third["extra_keys"] == [["tenant-a"], None]


def test_a_cache_salt_hides_a_prompt_from_other_salts(engines: dict[str, Served]) -> None:
    prompt = random_prompt(4 * BLOCK_SIZE + 1, seed=40)

    def cached_tokens(engine: Served) -> list[int]:
        engine.reset_prefix_cache()
        engine.complete(prompt, cache_salt="tenant-a")
        probes = [{"cache_salt": "tenant-b"}, {}, {"cache_salt": "tenant-a"}]
        usages = [engine.complete(prompt, **probe)["usage"] for probe in probes]
        return [usage["prompt_tokens_details"]["cached_tokens"] for usage in usages]

    assert on_each(engines, cached_tokens) == {"sim": [0, 0, 4 * BLOCK_SIZE], "vllm": [0, 0, 4 * BLOCK_SIZE]}


def test_reset_is_published_with_the_next_step(engine: Served) -> None:
    complete_and_collect(engine, random_prompt(BLOCK_SIZE + 1, seed=31))  # publishes any earlier reset
    assert engine.post("/reset_prefix_cache", None).json() == {"success": True}
    assert engine.events.pending() == []  # an idle engine takes no step, so publishes nothing
    prompt = random_prompt(BLOCK_SIZE + 3, seed=30)
    (batch,) = complete_and_collect(engine, prompt)
    assert [event["type"] for event in batch.events] == ["AllBlocksCleared", "BlockStored"]
    assert batch.events[0] == {"type": "AllBlocksCleared"}


def test_eviction_publishes_block_removed(engines: dict[str, Served]) -> None:
    def fill(engine: Served) -> list[dict[str, Any]]:
        engine.reset_prefix_cache()
        published: list[dict[str, Any]] = []
        for seed in range(100, 100 + MAX_EVICTING_PROMPTS):
            published += events(complete_and_collect(engine, random_prompt(EVICTING_PROMPT_TOKENS, seed)))
            if any(event["type"] == "BlockRemoved" for event in published):
                return published
        raise AssertionError(f"no BlockRemoved after {MAX_EVICTING_PROMPTS} prompts")

    published = on_each(engines, fill)
    assert published["sim"] == published["vllm"]  # the same blocks evicted, in the same order

    removed = [event for event in published["sim"] if event["type"] == "BlockRemoved"]
    stored = [event for event in published["sim"] if event["type"] == "BlockStored"]
    assert all(list(event) == BLOCK_REMOVED_FIELDS for event in removed)
    assert {(event["medium"], event["group_idx"]) for event in removed} == {("GPU", 0)}
    assert {digest for event in removed for digest in event["block_hashes"]} <= {
        digest for event in stored for digest in event["block_hashes"]
    }


def test_kv_event_sources_report_the_publisher(engines: dict[str, Served]) -> None:
    sources = on_each(engines, lambda engine: engine.http.get("/kv_event_sources").json())
    for name, engine in engines.items():
        assert list(sources[name]) == ["0"]
        assert sources[name]["0"]["endpoint"] == engine.kv_events_endpoint
    assert {**sources["sim"]["0"], "endpoint": None} == {**sources["vllm"]["0"], "endpoint": None}
