"""The peers' load, as each last published it: its :class:`~epp.sync.deltas.Totals` per endpoint.

A peer's totals for an endpoint replace what was held of that peer there, in the structures the
local plugins read: the token-load producer's ``peers`` (:class:`~epp.load.peer_totals.PeerTotals`)
and, for the predicted-latency producer's running TPOT SLOs, the peer's smallest SLO there,
which is all its headroom reads. Totals are absolute, so applying one twice, or one that a
snapshot already includes, changes nothing. Applying one is O(peers) (``PeerTotals`` sums over
them; the tail rows are kept as bytes).

A peer is named by its index (``epp.sync.membership.Peer.index``): an incarnation of a replica
that restarts gets a new one, so nothing of the old one's can be mistaken for the new one's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from epp.load.peer_totals import Counts, PeerTotals
from epp.sync.deltas import Totals


class PeerLoad:
    def __init__(
        self, token_load: PeerTotals | None, tpot_slos: dict[str, dict[Hashable, float]] | None
    ) -> None:
        """Either structure may be None (this replica's config has none); the totals are held here too."""
        self._token_load = token_load
        self._tpot_slos = tpot_slos
        self._totals: dict[int, dict[str, Counts]] = {}
        """Per peer, what it last published per endpoint where it has bookings."""
        self.on_freed: Callable[[], None] | None = None
        """Called when a peer published fewer requests or less prefill on an endpoint than before."""
        self.on_requests: Callable[[str], None] | None = None
        """Called with an endpoint where a peer published another number of requests than before."""

    def apply(self, peer: int, fields: object) -> str | None:
        """Replace what we hold of ``peer`` on one endpoint with its :class:`Totals` there, read
        from ``fields``; ``malformed`` if they are no totals, else None (applied)."""
        totals = Totals.read(fields)
        if totals is None:
            return "malformed"
        endpoint, requests, prefill, decode, remaining, kv, slo, tail_rows = totals
        counts = (requests, prefill, decode, remaining, kv)
        held = self._totals.get(peer)
        if held is None:
            held = self._totals[peer] = {}
        before = held.pop(endpoint, None)
        if requests:
            held[endpoint] = counts
        if self._token_load is not None:
            self._token_load.replace(peer, endpoint, counts, tail_rows)
        if self._tpot_slos is not None:
            self._set_tpot_slo(peer, endpoint, None if slo is None or not requests else float(slo))
        if before is not None and (requests < before[0] or prefill < before[1]):
            self._freed()
        if requests != (before[0] if before is not None else 0) and self.on_requests is not None:
            self.on_requests(endpoint)
        return None

    def forget(self, peer: int) -> None:
        """Drop everything ``peer`` published."""
        held = self._totals.pop(peer, {})
        if self._token_load is not None:
            self._token_load.clear(peer)
        if self._tpot_slos is not None:
            for endpoint in held:
                self._set_tpot_slo(peer, endpoint, None)
        if held:
            self._freed()

    def requests_on(self, endpoint: str) -> int:
        """The requests the peers last published as in flight on ``endpoint``."""
        return sum(counts[0] for held in self._totals.values() if (counts := held.get(endpoint)))

    def requests_of(self, peer: int) -> int:
        """The requests ``peer`` last published as in flight, over every endpoint."""
        return sum(counts[0] for counts in self._totals.get(peer, {}).values())

    def _set_tpot_slo(self, peer: int, endpoint: str, slo: float | None) -> None:
        running = self._tpot_slos
        assert running is not None
        key = ("peer", peer)  # a peer's key among the running SLOs' bookings
        if slo is not None:
            running.setdefault(endpoint, {})[key] = slo
        elif (on_endpoint := running.get(endpoint)) is not None:
            on_endpoint.pop(key, None)

    def _freed(self) -> None:
        if self.on_freed is not None:
            self.on_freed()
