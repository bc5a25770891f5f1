"""The flow controller: per-band queues of per-flow queues, their limits, and the dispatch loop.

Pure and synchronous: every call takes ``now`` and returns the :class:`Decision` s it made; an
adapter (the live gate, the fleet simulator) acts on them. A request leaves the queue exactly
once: dispatched, expired, rejected or evicted (both answered 429), or cancelled.

Dispatch is strict by band (a lower band waits while a higher one has requests), fair across a
band's flows (the fairness policy), ordered inside a flow (the ordering policy), and only while
no saturation detector objects to the request at the head. When the detectors object to the
chosen flow's head but not to another flow's (a smaller request), that one goes: no flow waits
behind another flow's large request while the pool has room for its own. A detector may also
say the head fits only some endpoints: it is dispatched with those (``Decision.endpoints``), and
the driver holds the pick to them. The controller books what it dispatches until the request
finishes, so detectors see its load before the next scrape does; once routed, its prompt is
booked as prefill by its uncached tokens there (the pick's prefix match).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epp.flowcontrol.fairness import FairnessPolicy
from epp.flowcontrol.ordering import OrderingPolicy
from epp.flowcontrol.peers import NO_PEERS, PeerTokenLoad
from epp.flowcontrol.prefix import PrefixEstimate
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.types import Booking, Decision, FlowRequest, Outcome, PoolView
from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import CycleState
from epp.scheduling.types import EndpointState


@dataclass(frozen=True, slots=True)
class BandLimits:
    max_requests: int = 1000
    """Requests the band may hold; past it, newcomers are rejected."""
    ttl_s: float = 4.0
    """How long a request may wait before it is answered 429."""


@dataclass(frozen=True, slots=True)
class FlowSettings:
    bands: Mapping[int, BandLimits] = field(default_factory=dict)
    default_band: BandLimits = BandLimits()
    """Limits of every band not listed in ``bands``."""
    max_queued: int = 5000
    """Requests all bands together may hold; past it a newcomer pushes out the newest request
    of the lowest sheddable band below its own, or is rejected."""
    retry_after_s: int = 1

    def limits(self, band: int) -> BandLimits:
        return self.bands.get(band, self.default_band)


class _Flow:
    """One flow's queue in one band: a heap by the ordering key, with lazy removal."""

    __slots__ = ("heap", "size")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, FlowRequest]] = []
        self.size = 0


class FlowController:
    def __init__(
        self,
        settings: FlowSettings,
        fairness: FairnessPolicy,
        ordering: OrderingPolicy,
        detectors: Sequence[SaturationDetector],
    ) -> None:
        self.settings = settings
        self.fairness = fairness
        self.ordering = ordering
        self.detectors = list(detectors)
        self._bands: dict[int, dict[str, _Flow]] = {}
        self._band_sizes: dict[int, int] = {}
        self._queued: dict[int, FlowRequest] = {}
        self._expiry: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self._bookings: dict[int, Booking] = {}
        self._booked_tokens: dict[str, int] = {}
        self._prefill_tokens: dict[str, int] = {}
        self._routed_at: dict[str, dict[int, float]] = {}
        self._pending_requests = 0
        self._pending_tokens = 0
        self.saturated = False
        """Whether the last dispatch attempt found the pool saturated."""
        self.peers: PeerTokenLoad | None = None
        """Peer replicas' synced token load, read at each dispatch attempt (set by the driver
        when replicas share token load; None: this replica counts its own bookings only)."""
        self.prefix: PrefixEstimate | None = None
        """Where held requests' prompts are likely cached (set by the builder when a detector uses
        it and the pipeline has an approximate prefix index; None: nowhere)."""

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, key: int) -> bool:
        return key in self._queued

    def queue_sizes(self) -> dict[tuple[int, str], int]:
        """(band, flow) → requests waiting, for every non-empty flow."""
        return {(b, f): q.size for b, flows in self._bands.items() for f, q in flows.items()}

    def next_expiry(self) -> float | None:
        """When the earliest queued request expires (possibly already cancelled), or None."""
        while self._expiry and self._expiry[0][2] not in self._queued:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    def booked(self) -> int:
        """Requests dispatched and not finished."""
        return len(self._bookings)

    # ------------------------------------------------------------------ queueing

    def enqueue(self, request: FlowRequest, now: float) -> list[Decision]:
        """Queue ``request`` (stamped with ``now`` and its arrival order). Returns the rejection of
        ``request`` itself, or the eviction it caused, when a queue was full; dispatching is
        :meth:`poll`'s."""
        if request.key in self._queued or request.key in self._bookings:
            raise ValueError(f"request {request.key} is already in flow control")
        request.enqueued_at = now
        request.seq = next(self._seq)
        limits = self.settings.limits(request.band)
        if self._band_sizes.get(request.band, 0) >= limits.max_requests:
            return [Decision(request, Outcome.REJECTED, now)]
        decisions = []
        if len(self._queued) >= self.settings.max_queued:
            victim = self._eviction_victim(request.band)
            if victim is None:
                return [Decision(request, Outcome.REJECTED, now)]
            self._remove(victim)
            decisions.append(Decision(victim, Outcome.EVICTED, now))
        self._add(request, limits)
        return decisions

    def cancel(self, key: int, now: float) -> Decision | None:
        """The client of queued request ``key`` went away: it leaves the queue now. None when it
        is not queued (already dispatched or answered)."""
        request = self._queued.get(key)
        if request is None:
            return None
        self._remove(request)
        return Decision(request, Outcome.CANCELLED, now)

    def _add(self, request: FlowRequest, limits: BandLimits) -> None:
        flows = self._bands.setdefault(request.band, {})
        flow = flows.get(request.flow)
        if flow is None:
            flow = flows[request.flow] = _Flow()
            self.fairness.activated(request.band, request.flow)
        heapq.heappush(flow.heap, (self.ordering.key(request), request.seq, request))
        flow.size += 1
        self._band_sizes[request.band] = self._band_sizes.get(request.band, 0) + 1
        self._queued[request.key] = request
        if math.isfinite(limits.ttl_s):
            heapq.heappush(self._expiry, (request.enqueued_at + limits.ttl_s, request.seq, request.key))

    def _remove(self, request: FlowRequest) -> None:
        """Take ``request`` out of the queue; its heap entry is dropped lazily."""
        del self._queued[request.key]
        flows = self._bands[request.band]
        flow = flows[request.flow]
        flow.size -= 1
        if flow.size == 0:
            del flows[request.flow]
        self._band_sizes[request.band] -= 1
        if self._band_sizes[request.band] == 0:
            del self._band_sizes[request.band]
            del self._bands[request.band]

    def _eviction_victim(self, band: int) -> FlowRequest | None:
        """The newest request of the lowest sheddable band below ``band``."""
        sheddable = [b for b in self._band_sizes if b < 0 and b < band]
        if not sheddable:
            return None
        lowest = min(sheddable)
        return max((r for r in self._queued.values() if r.band == lowest), key=lambda r: r.seq)

    def _head(self, flow: _Flow) -> FlowRequest:
        heap = flow.heap
        while self._queued.get(heap[0][2].key) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0][2]

    # ------------------------------------------------------------------ dispatch

    def poll(self, now: float, endpoints: Sequence[EndpointState]) -> list[Decision]:
        """Expire what waited too long, then dispatch, highest band first, while the pool has room."""
        decisions = self._expire(now)
        while self._bands:
            band = max(self._bands)
            chosen = self._fitting_head(band, now, endpoints)
            self.saturated = chosen is None
            if chosen is None:
                break
            flow_id, head, fitting = chosen
            self._remove(head)
            self.fairness.charged(band, flow_id, head.tokens)
            self._bookings[head.key] = Booking(head.tokens, now, prefill_tokens=head.prompt_tokens)
            self._pending_requests += 1
            self._pending_tokens += head.tokens
            decisions.append(Decision(head, Outcome.DISPATCHED, now, fitting))
        else:
            self.saturated = False
        return decisions

    def _fitting_head(
        self, band: int, now: float, endpoints: Sequence[EndpointState]
    ) -> tuple[str, FlowRequest, frozenset[str] | None] | None:
        """The head of the flow the fairness policy picks, or, when the pool has no room for that
        request (a detector that weighs its size), of the next flow it would pick: a large
        request at the head of one flow does not hold back a smaller one of another. With it,
        the endpoints it fits (None: any). None when no flow's head fits."""
        flows = self._bands[band]
        candidates = list(flows)
        view = self._view(now, endpoints)
        while candidates:
            flow_id = self.fairness.pick(band, candidates)
            head = self._head(flows[flow_id])
            if not any(d.saturated(view, head) for d in self.detectors):
                fitting = self._fitting_endpoints(view, head)
                if fitting is None or fitting:
                    return flow_id, head, fitting
            candidates.remove(flow_id)
        return None

    def _fitting_endpoints(self, view: PoolView, head: FlowRequest) -> frozenset[str] | None:
        """The endpoints every detector says ``head`` fits (None: any)."""
        fitting = None
        for detector in self.detectors:
            mine = detector.endpoints(view, head)
            if mine is not None:
                fitting = mine if fitting is None else fitting & mine
        return fitting

    def _expire(self, now: float) -> list[Decision]:
        decisions = []
        while (when := self.next_expiry()) is not None and when <= now:
            _, _, key = heapq.heappop(self._expiry)
            request = self._queued[key]
            self._remove(request)
            decisions.append(Decision(request, Outcome.EXPIRED, now))
        return decisions

    def _view(self, now: float, endpoints: Sequence[EndpointState]) -> PoolView:
        peers = NO_PEERS if self.peers is None else self.peers.read(endpoints)
        return PoolView(
            now=now,
            endpoints=endpoints,
            booked_tokens=self._booked_tokens,
            prefill_tokens=self._prefill_tokens,
            routed_at=self._routed_at,
            pending_requests=self._pending_requests,
            pending_tokens=self._pending_tokens,
            peer_tokens=peers.tokens,
            peer_prefill_tokens=peers.prefill_tokens,
            replicas=peers.replicas,
            cached_tokens=None if self.prefix is None else self.prefix.cached_tokens,
        )

    # ------------------------------------------------------------------ after dispatch

    def routed(self, key: int, endpoint: str, state: CycleState, now: float) -> None:
        """Dispatched request ``key`` was scheduled onto ``endpoint``; ``state``'s prefix match
        (when the pipeline made one) says how much of the prompt is left to prefill there."""
        booking = self._bookings.get(key)
        if booking is None or booking.endpoint is not None:
            return
        booking.endpoint, booking.routed_at = endpoint, now
        match = state.get(PREFIX_MATCH)
        if match is not None:
            booking.prefill_tokens -= match.cached_tokens(endpoint, booking.prefill_tokens)
        self._pending_requests -= 1
        self._pending_tokens -= booking.tokens
        _add(self._booked_tokens, endpoint, booking.tokens)
        _add(self._prefill_tokens, endpoint, booking.prefill_tokens)
        self._routed_at.setdefault(endpoint, {})[key] = now
        for detector in self.detectors:
            detector.routed(endpoint, state, now)

    def first_token(self, key: int) -> None:
        """Routed request ``key`` produced its first token: its prompt is no longer prefill. Idempotent."""
        booking = self._bookings.get(key)
        if booking is None or booking.endpoint is None:
            return
        _add(self._prefill_tokens, booking.endpoint, -booking.prefill_tokens)
        booking.prefill_tokens = 0

    def finished(self, key: int) -> None:
        """Dispatched request ``key`` is over (completed, failed, refused or cancelled). Idempotent."""
        booking = self._bookings.pop(key, None)
        if booking is None:
            return
        if booking.endpoint is None:
            self._pending_requests -= 1
            self._pending_tokens -= booking.tokens
            return
        _add(self._booked_tokens, booking.endpoint, -booking.tokens)
        _add(self._prefill_tokens, booking.endpoint, -booking.prefill_tokens)
        times = self._routed_at[booking.endpoint]
        del times[key]
        if not times:
            del self._routed_at[booking.endpoint]


def _add(tokens: dict[str, int], endpoint: str, delta: int) -> None:
    """Add ``delta`` to ``endpoint``'s count, dropping it at zero (the maps hold busy endpoints only)."""
    left = tokens.get(endpoint, 0) + delta
    if left:
        tokens[endpoint] = left
    else:
        tokens.pop(endpoint, None)
