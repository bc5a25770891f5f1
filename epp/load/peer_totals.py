"""Peer EPP replicas' token load: per endpoint, the totals each peer last published, replaced whole.

With replica sync (``epp.sync``) every replica publishes, per endpoint, the totals of its own
bookings there (an :class:`~epp.load.token_load.EndpointLoad`) when they change, at most twice
per sync tick, and its peers replace what they held of that replica for that endpoint. Applying
a peer's load therefore costs O(1) per endpoint published, whatever the pool's request rate,
and a publication that is lost heals with the next one of that endpoint.

A publication also lists that replica's live bookings on the endpoint that name their prompt's
tail (the chained hash of the prompt's last full block), one row each: ``(tail, prompt_tokens,
prefill_tokens, decode_tokens, expected_remaining_tokens, kv_tokens)`` as uint64. They are kept
as received (a numpy view, read only when a prompt is looked up), so that a replica routing a
conversation's next turn can take the previous turn's load off at once
(:meth:`PeerTotals.continue_turn`, ``epp.plugins.token_load``) instead of one sync lag later.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from epp.load.token_load import NO_LOAD, EndpointLoad

TAIL_ROW_FIELDS = 6
"""uint64s per tail row: tail, prompt_tokens, then the booking's load without its request."""
NO_TAILS = np.zeros((0, TAIL_ROW_FIELDS), dtype="<u8")


def row_load(row: np.ndarray) -> EndpointLoad:
    """The load one tail row's booking adds to its endpoint."""
    return EndpointLoad(1, *(int(v) for v in row[2:]))


@dataclass(slots=True)
class _Published:
    load: EndpointLoad
    tails: np.ndarray
    continued: set[int] = field(default_factory=set)
    """Tails whose booking a local prompt continued: their rows' load is not counted."""
    effective: EndpointLoad = NO_LOAD

    def settle(self) -> None:
        """Recount ``effective``: the load less the continued bookings (each tail's first row)."""
        effective = self.load
        for tail in self.continued:
            (rows,) = np.nonzero(self.tails[:, 0] == np.uint64(tail))
            effective = effective - row_load(self.tails[rows[0]])
        self.effective = effective


class PeerTotals:
    """Each peer's last published load per endpoint; reads give the sum over the peers."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, dict[Hashable, _Published]] = {}
        self._sums: dict[str, EndpointLoad] = {}
        self._requests = 0
        self._tailed = 0
        """Publications held that list at least one tail row."""

    def replace(
        self, peer: Hashable, endpoint: str, load: EndpointLoad, tails: np.ndarray = NO_TAILS
    ) -> None:
        """``peer`` now has ``load`` on ``endpoint``, with these tail rows (``(n, 6)`` uint64).

        A continued booking stays uncounted while its row is still listed: a publication made
        before its release may arrive after the local prompt that continued it."""
        entries = self._by_endpoint.setdefault(endpoint, {})
        old = entries.pop(peer, None)
        if old is not None:
            self._requests -= old.effective.requests
            self._tailed -= bool(len(old.tails))
        if load.requests:
            listed = set(tails[:, 0].tolist()) if old is not None and old.continued else set()
            published = _Published(load, tails, old.continued & listed if old is not None else set())
            published.settle()
            entries[peer] = published
            self._requests += published.effective.requests
            self._tailed += bool(len(tails))
        self._resum(endpoint)

    def clear(self, peer: Hashable) -> None:
        """Forget everything ``peer`` published (it left, restarted or is being re-snapshotted)."""
        for endpoint, entries in list(self._by_endpoint.items()):
            if peer in entries:
                self.replace(peer, endpoint, NO_LOAD)

    def continue_turn(self, endpoint: str, tail: int, prompt_tokens: int) -> bool:
        """A local prompt of ``prompt_tokens`` extends the prompt that ends at ``tail`` on
        ``endpoint``. If exactly one peer booking there ends at ``tail`` (a prefix that concurrent
        requests share does not count) and its prompt is shorter, that booking is over: its load
        leaves now. Returns whether it did."""
        matches = [
            (published, rows)
            for published in self._by_endpoint.get(endpoint, {}).values()
            if len(published.tails) and len(rows := np.nonzero(published.tails[:, 0] == np.uint64(tail))[0])
        ]
        if len(matches) != 1 or len(matches[0][1]) != 1:
            return False
        published, (row,) = matches[0]
        if tail in published.continued or int(published.tails[row, 1]) >= prompt_tokens:
            return False
        published.continued.add(tail)
        self._requests -= published.effective.requests
        published.settle()
        self._requests += published.effective.requests
        self._resum(endpoint)
        return True

    def _resum(self, endpoint: str) -> None:
        entries = self._by_endpoint[endpoint]
        if not entries:
            del self._by_endpoint[endpoint]
            self._sums.pop(endpoint, None)
            return
        total = NO_LOAD
        for published in entries.values():
            total = total + published.effective
        self._sums[endpoint] = total

    def load(self, endpoint: str) -> EndpointLoad:
        """The peers' load on ``endpoint``, continued bookings left out."""
        return self._sums.get(endpoint, NO_LOAD)

    def in_flight(self) -> int:
        """The peers' requests in flight, over every endpoint."""
        return self._requests

    def has_tails(self) -> bool:
        """Whether any publication held lists a tail row."""
        return self._tailed > 0
