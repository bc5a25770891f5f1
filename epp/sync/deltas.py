"""The typed bodies of sync messages: what a DELTAS, SNAPSHOT or HEARTBEAT carries (``epp.sync.messages``).

The wire stays msgpack positional arrays (the schema in ``epp.sync.messages``); these types are
that schema's fields by name at the edges. Each has ``fields()``, its wire array, and ``read``,
which checks a received array: None if it is not one (malformed). A delta in a DELTAS body is
``[kind, *fields]``; a snapshot carries the fields alone.

A delta is read where it is applied, one by one, so one malformed delta is dropped (counted)
and the rest of its message still applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Self

from epp.load.peer_totals import TAIL_ROW_BYTES
from epp.sync.messages import Capability, DeltaKind, heartbeat_bytes_per_token, heartbeat_capabilities

# Read once, not per delta: reading deltas is the apply path that llm-epp-bench sync-apply measures.
_tuple_new = tuple.__new__
_NUMBER = (int, float)


class Totals(NamedTuple):
    """TOTALS: a replica's own load on ``endpoint`` now (absolute: the receiver replaces what it held)."""

    endpoint: str
    requests: int
    """0: nothing of the sender's left there."""
    prefill_tokens: int
    decode_tokens: int
    expected_remaining_tokens: int
    kv_tokens: int
    min_tpot_slo_ms: float | None
    """The smallest TPOT SLO among its streaming requests there (None: none runs)."""
    tail_rows: bytes
    """Its bookings there that name their prompt's tail (``epp.load.peer_totals.pack_tail_rows``)."""

    def fields(self) -> list[Any]:
        return list(self)

    def delta(self) -> list[Any]:
        return [DeltaKind.TOTALS, *self]

    @classmethod
    def read(cls, fields: object) -> Self | None:
        if not isinstance(fields, list) or len(fields) != 8:
            return None
        endpoint, requests, prefill, decode, remaining, kv, slo, rows = fields
        if (
            type(endpoint) is not str
            or type(rows) is not bytes
            or len(rows) % TAIL_ROW_BYTES
            or not type(requests) is type(prefill) is type(decode) is type(remaining) is type(kv) is int
            or requests < 0
            or prefill < 0
            or decode < 0
            or remaining < 0
            or kv < 0
            or not (slo is None or (isinstance(slo, _NUMBER) and slo > 0))
        ):
            return None
        return _tuple_new(cls, fields)  # as _make, without its length check: done above


class PrefixInsert(NamedTuple):
    """PREFIX: prompt blocks recorded for ``endpoint`` in the approximate prefix index."""

    endpoint: str
    block_size: int
    """Tokens per block; applied only where the local index's block size is the same."""
    hashes: bytes
    """The block hashes as little-endian uint64 (``epp.sync.messages.pack_hashes``)."""

    def fields(self) -> list[Any]:
        return list(self)

    def delta(self) -> list[Any]:
        return [DeltaKind.PREFIX, *self]

    @classmethod
    def read(cls, fields: object) -> Self | None:
        # block_size is only compared with the local index's, so any value reads.
        if not isinstance(fields, list) or len(fields) != 3:
            return None
        endpoint, _, hashes = fields
        if not isinstance(endpoint, str) or not isinstance(hashes, bytes) or len(hashes) % 8:
            return None
        return _tuple_new(cls, fields)  # as _make, without its length check: done above


class Snapshot(NamedTuple):
    """SNAPSHOT: the sender's totals on every endpoint where it has bookings, and the most recent
    blocks of its approximate prefix index. Read whole here; each entry is read as it is installed."""

    totals: list[Any]
    prefix: list[Any]

    @staticmethod
    def body(totals: Sequence[Totals], prefix: Sequence[PrefixInsert]) -> list[Any]:
        return [[t.fields() for t in totals], [p.fields() for p in prefix]]

    @classmethod
    def read(cls, body: Sequence[Any]) -> Self | None:
        """The two lists of entries, unread; None if ``body`` is not ``[totals, prefix]``."""
        if len(body) != 2 or not all(isinstance(part, list) for part in body):
            return None
        return cls._make(body)


class Heartbeat(NamedTuple):
    """HEARTBEAT: what the sender does, and its estimate's bytes per token if it announces one."""

    capabilities: Capability
    bytes_per_token: float | None

    def body(self) -> list[Any]:
        if self.bytes_per_token is None:
            return [int(self.capabilities)]
        return [int(self.capabilities), self.bytes_per_token]

    @classmethod
    def read(cls, body: Sequence[Any]) -> Self:
        """Never malformed: what a body does not announce readably is read as not announced."""
        return cls(heartbeat_capabilities(body), heartbeat_bytes_per_token(body))
