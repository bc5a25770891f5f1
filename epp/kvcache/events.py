"""vLLM KV events: the wire format decoded, and one endpoint's batches applied in order.

On the wire (vLLM 0.32's ``ZmqEventPublisher``; checked against the recorded fixture and the
conformance suite) a batch is a PUB message of three frames::

    [topic, seq (8-byte big-endian, 0, 1, 2, ... per publisher), msgpack([ts, [event, ...], dp_rank])]

Each event is a map whose ``type`` is ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``medium``, and token ids, LoRA name, extra keys, group, that this index does not need),
``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``. Block hashes are
64-bit ints, or digests when the engine runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
(reduced here to the same low 64 bits). Only ``GPU`` blocks are indexed (vLLM says ``GPU`` on
CPU too); blocks that an offloading connector reports for other media are skipped.

Replay: a DEALER sends ``[b"", start_seq (8 bytes)]`` to the publisher's ROUTER, which answers
``[b"", topic, seq, payload]`` for each buffered batch from ``start_seq`` on, then
``[b"", b"", -1 (8-byte signed), b""]``.

:class:`EventStream` is the pure part of a subscriber: it applies one endpoint's batches to a
:class:`PreciseIndex` in sequence order, says when batches are missing, and takes the replay
answer (filling the gap, or clearing the endpoint and rebuilding from what replay still had).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from epp.kvcache.precise_index import PreciseIndex

log = logging.getLogger(__name__)

END_SEQ = -1
INDEXED_MEDIA = (None, "GPU")
_LOW_64 = (1 << 64) - 1


class KVEventDecodeError(ValueError):
    """A batch that is not vLLM's wire format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    unknown: int = 0
    """Events of a type this index does not know (skipped)."""


def _block_hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LOW_64:
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _LOW_64
    raise KVEventDecodeError(f"bad block hash {value!r}")


def _hashes(event: dict[Any, Any]) -> tuple[int, ...]:
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list):
        raise KVEventDecodeError(f"{event.get('type')} without block_hashes")
    return tuple(_block_hash(h) for h in hashes)


def _event(event: Any) -> KVEvent | None:
    if not isinstance(event, dict):
        raise KVEventDecodeError(f"event is not a map: {event!r}")
    kind = event.get("type")
    if kind == "BlockStored":
        parent = event.get("parent_block_hash")
        return BlockStored(
            _hashes(event), None if parent is None else _block_hash(parent), event.get("medium")
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(event), event.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVEventDecodeError(f"seq frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(seq_frame: bytes, payload: bytes) -> EventBatch:
    """One batch from its seq frame and msgpack payload."""
    seq = decode_seq(seq_frame)
    try:
        decoded = msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVEventDecodeError(f"batch {seq}: not msgpack: {exc}") from exc
    if not isinstance(decoded, list) or len(decoded) < 2 or not isinstance(decoded[1], list):
        raise KVEventDecodeError(f"batch {seq}: not [ts, events, rank]")
    ts, raw = decoded[0], decoded[1]
    events = [_event(e) for e in raw]
    known = tuple(e for e in events if e is not None)
    return EventBatch(seq, float(ts), known, len(events) - len(known))


def apply_events(index: PreciseIndex, endpoint: str, events: Sequence[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            if event.medium in INDEXED_MEDIA:
                index.store(endpoint, event.block_hashes, event.parent_block_hash)
        elif isinstance(event, BlockRemoved):
            if event.medium in INDEXED_MEDIA:
                index.remove(endpoint, event.block_hashes)
        else:
            index.clear(endpoint)


class EventStream:
    """One endpoint's batches, applied to ``index`` in sequence order.

    Feed live batches to :meth:`accept`. When it reports missing batches, ask the publisher to
    replay from the seq it returns and hand the answer (possibly empty: no replay socket, or
    no answer) to :meth:`recover` with the live batch that revealed the gap.
    """

    def __init__(self, index: PreciseIndex, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.next_seq = 0
        self._last_live = -1
        self.restarts = 0
        """Times the publisher started over (its seqs went back): the endpoint was cleared."""

    def _apply(self, batch: EventBatch) -> None:
        apply_events(self.index, self.endpoint, batch.events)
        self.next_seq = batch.seq + 1

    def _restart_at(self, batch: EventBatch) -> None:
        self.index.clear(self.endpoint)
        self._apply(batch)

    def catch_up(self, replayed: Sequence[EventBatch]) -> None:
        """Apply a replay fetched before any live batch (the engine's recent history)."""
        for batch in _latest_run(replayed):
            if batch.seq >= self.next_seq:
                self._apply(batch)

    def accept(self, batch: EventBatch) -> int | None:
        """Apply a live batch; if batches before it are missing, apply nothing and return the
        seq to replay from."""
        if batch.seq > self.next_seq:
            return self.next_seq
        if batch.seq == self.next_seq:
            self._apply(batch)
        elif batch.seq <= self._last_live:
            # The live stream went backwards: the publisher restarted with an empty cache.
            log.warning("KV events of %s restarted at seq %d", self.endpoint, batch.seq)
            self.restarts += 1
            self._restart_at(batch)
        # Otherwise a batch that replay already applied.
        self._last_live = batch.seq
        return None

    def recover(self, replayed: Sequence[EventBatch], live: EventBatch) -> bool:
        """Resolve the gap before ``live`` with the replay answer. True when the replay filled it;
        False when it could not, and the endpoint's entries were cleared and rebuilt from the
        latest batches replay still had (its cache is then known only in part)."""
        for batch in replayed:
            if batch.seq == self.next_seq and batch.seq < live.seq:
                self._apply(batch)
        filled = self.next_seq == live.seq
        if not filled:
            self.index.clear(self.endpoint)
            for batch in _latest_run([b for b in replayed if b.seq < live.seq]):
                self._apply(batch)
        if self.next_seq == live.seq:
            self._apply(live)
        else:
            self._restart_at(live)
        self._last_live = live.seq
        return filled


def _latest_run(batches: Sequence[EventBatch]) -> Sequence[EventBatch]:
    """The trailing run of consecutive seqs of ``batches`` (sorted by seq)."""
    start = len(batches)
    while start > 0 and (start == len(batches) or batches[start - 1].seq == batches[start].seq - 1):
        start -= 1
    return batches[start:]
