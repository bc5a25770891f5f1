"""Peer EPP replicas' token load: per endpoint, the totals each peer last published, replaced whole.

With replica sync (``epp.sync``) every replica publishes, per endpoint, the totals of its own
bookings there (the fields of an :class:`~epp.load.token_load.EndpointLoad`, in order) when they
change, at most twice per sync tick, and its peers replace what they held of that replica for
that endpoint. Applying a peer's load therefore costs O(1) per endpoint published, whatever the
pool's request rate, and a publication that is lost heals with the next one of that endpoint.

A publication also lists that replica's live bookings on the endpoint that name their prompt's
tail (the chained hash of the prompt's last full block), one row each: ``(tail, prompt_tokens,
prefill_tokens, decode_tokens, expected_remaining_tokens, kv_tokens)`` as little-endian uint64.
They are kept as received and read only when a prompt is looked up, so that a replica routing
a conversation's next turn can take the previous turn's load off at once
(:meth:`PeerTotals.continue_turn`, ``epp.plugins.token_load``) instead of one sync lag later.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from epp.load.token_load import NO_LOAD, EndpointLoad

Counts = tuple[int, int, int, int, int]
"""An :class:`EndpointLoad`'s fields, in order (plain ints: cheaper to apply than the class)."""
NO_COUNTS: Counts = (0, 0, 0, 0, 0)
TAIL_ROW_FIELDS = 6
TAIL_ROW_BYTES = 8 * TAIL_ROW_FIELDS


_ROW = struct.Struct(f"<{TAIL_ROW_FIELDS}Q")


def pack_tail_row(row: Sequence[int]) -> bytes:
    """One tail row as a publication carries it (see the module)."""
    return _ROW.pack(*row)


def pack_tail_rows(rows: Iterable[Sequence[int]]) -> bytes:
    """Tail rows as a publication carries them (see the module)."""
    return b"".join(map(pack_tail_row, rows))


def unpack_tail_rows(tails: bytes) -> np.ndarray:
    """The ``(n, 6)`` uint64 view of packed tail rows."""
    return np.frombuffer(tails, dtype="<u8").reshape(-1, TAIL_ROW_FIELDS)


def _minus(counts: Counts, row: np.ndarray) -> Counts:
    """``counts`` less the booking of one tail row."""
    requests, prefill, decode, remaining, kv = counts
    return (
        requests - 1,
        prefill - int(row[2]),
        decode - int(row[3]),
        remaining - int(row[4]),
        kv - int(row[5]),
    )


@dataclass(slots=True)
class _Published:
    counts: Counts
    tails: bytes
    continued: set[int]
    """Tails whose booking a local prompt continued: their rows are not counted."""
    effective: Counts = NO_COUNTS

    def settle(self) -> None:
        """Recount ``effective``: the counts less the continued bookings (each tail's first row)."""
        effective = self.counts
        if self.continued:
            rows = unpack_tail_rows(self.tails)
            for tail in self.continued:
                effective = _minus(effective, rows[np.nonzero(rows[:, 0] == np.uint64(tail))[0][0]])
        self.effective = effective


class PeerTotals:
    """Each peer's last published load per endpoint; reads give the sum over the peers."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, dict[Hashable, _Published]] = {}
        self._sums: dict[str, EndpointLoad] = {}
        """Read-through cache of :meth:`load` (a publication drops its endpoint's sum)."""
        self._requests = 0
        self._tailed = 0
        """Publications held that list at least one tail row."""

    def replace(self, peer: Hashable, endpoint: str, counts: Counts, tails: bytes = b"") -> None:
        """``peer`` now has ``counts`` on ``endpoint`` (requests 0: nothing), with these packed
        tail rows; ValueError if they are not whole rows.

        A continued booking stays uncounted while its row is still listed: a publication made
        before its release may arrive after the local prompt that continued it."""
        if len(tails) % TAIL_ROW_BYTES:
            raise ValueError("tail rows are not whole")
        entries = self._by_endpoint.get(endpoint)
        if entries is None:  # not setdefault: that builds a dict per delta applied
            entries = self._by_endpoint[endpoint] = {}
        old = entries.pop(peer, None)
        continued: set[int] = set()
        if old is not None:
            self._requests -= old.effective[0]
            self._tailed -= bool(old.tails)
            if old.continued and tails:
                continued = old.continued & set(unpack_tail_rows(tails)[:, 0].tolist())
        if counts[0]:
            # Settled as published unless a booking was continued: this runs per delta applied.
            published = _Published(counts, tails, continued, counts)
            if continued:
                published.settle()
            entries[peer] = published
            self._requests += published.effective[0]
            self._tailed += bool(tails)
        elif not entries:
            del self._by_endpoint[endpoint]
        self._sums.pop(endpoint, None)

    def clear(self, peer: Hashable) -> None:
        """Forget everything ``peer`` published (it left, restarted or is being re-snapshotted)."""
        for endpoint, entries in list(self._by_endpoint.items()):
            if peer in entries:
                self.replace(peer, endpoint, NO_COUNTS)

    def continue_turn(self, endpoint: str, tail: int, prompt_tokens: int) -> bool:
        """A local prompt of ``prompt_tokens`` extends the prompt that ends at ``tail`` on
        ``endpoint``. If exactly one peer booking there ends at ``tail`` (a prefix that concurrent
        requests share does not count) and its prompt is shorter, that booking is over: its load
        leaves now. Returns whether it did."""
        matches = []
        for published in self._by_endpoint.get(endpoint, {}).values():
            if published.tails and tail not in published.continued:  # continued ones are over
                rows = unpack_tail_rows(published.tails)
                matches += [(published, rows[i]) for i in np.nonzero(rows[:, 0] == np.uint64(tail))[0]]
        if len(matches) != 1:
            return False
        published, row = matches[0]
        if int(row[1]) >= prompt_tokens:
            return False
        published.continued.add(tail)
        self._requests -= published.effective[0]
        published.settle()
        self._requests += published.effective[0]
        self._sums.pop(endpoint, None)
        return True

    def load(self, endpoint: str) -> EndpointLoad:
        """The peers' load on ``endpoint``, continued bookings left out."""
        cached = self._sums.get(endpoint)
        if cached is None:
            entries = self._by_endpoint.get(endpoint)
            if entries:
                cached = EndpointLoad(*map(sum, zip(*(p.effective for p in entries.values()), strict=True)))
            else:
                cached = NO_LOAD
            self._sums[endpoint] = cached
        return cached

    def in_flight(self) -> int:
        """The peers' requests in flight, over every endpoint."""
        return self._requests

    def has_tails(self) -> bool:
        """Whether any publication held lists a tail row."""
        return self._tailed > 0
