"""Sharing the approximate prefix index between replicas: our inserts out, the peers' in.

Every prompt's blocks this replica records for an endpoint go out as a
:class:`~epp.sync.deltas.PrefixInsert` with the next take (the same blocks twice in one take,
once: one RL step's rollouts insert the same prompt together); a peer's insert is recorded in
the local index, which does not tell whose insert a block was. A snapshot carries the index's
most recent blocks per endpoint, so a replica that joins scores prefixes before it has seen any
insert. Inserts are not coalesced like totals: they are bounded by the unique prompt content.

Replicas of one pool are assumed to run the same EndpointPickerConfig: an insert applies only
when its block size equals the local index's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from epp.sync.deltas import PrefixInsert
from epp.sync.messages import pack_hashes, unpack_hashes

RecordPrefix = Callable[[str, list[int]], None]
"""Record that an endpoint was sent these prompt blocks (the approximate prefix index)."""
RecentBlocks = Callable[[int], list[tuple[str, list[int]]]]
"""The index's most recent blocks per endpoint, oldest first, at most this many in all."""


class PrefixShare:
    def __init__(
        self,
        wake: Callable[[], None],
        record: RecordPrefix | None,
        block_size: int,
        recent_blocks: RecentBlocks | None,
    ) -> None:
        """``wake`` is called before an insert is queued (the outbox's wake-up). ``record`` and
        ``recent_blocks`` are the local index's (None: this replica has none), ``block_size``
        its tokens per block."""
        self._wake = wake
        self._record = record
        self._block_size = block_size
        self._recent_blocks = recent_blocks
        self._queued: dict[PrefixInsert, None] = {}

    @property
    def any_queued(self) -> bool:
        return bool(self._queued)

    def inserted(self, endpoint: str, block_size: int, block_hashes: Sequence[int]) -> None:
        """We recorded these prompt blocks for ``endpoint``: they go out with the next take."""
        if block_hashes:
            self._wake()
            self._queued[PrefixInsert(endpoint, block_size, pack_hashes(block_hashes))] = None

    def take(self) -> list[PrefixInsert]:
        """The queued inserts, in order; none is queued after."""
        if not self._queued:
            return []
        taken, self._queued = list(self._queued), {}
        return taken

    def recent(self, limit: int) -> list[PrefixInsert]:
        """The local index's most recent blocks, at most ``limit``, as a snapshot carries them."""
        if self._recent_blocks is None:
            return []
        return [
            PrefixInsert(endpoint, self._block_size, pack_hashes(hashes))
            for endpoint, hashes in self._recent_blocks(limit)
        ]

    def apply(self, peer: int, fields: object) -> str | None:
        """Record a peer's :class:`PrefixInsert`, read from ``fields`` (whose it was is not kept:
        ``peer`` is unused); the reason it was dropped (``malformed``; ``unused``: no index here;
        ``block_size``: another block size), or None."""
        insert = PrefixInsert.read(fields)
        if insert is None:
            return "malformed"
        if self._record is None:
            return "unused"
        if insert.block_size != self._block_size:
            return "block_size"
        self._record(insert.endpoint, unpack_hashes(insert.hashes))
        return None
