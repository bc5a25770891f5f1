"""Plain data of flow control: a queued request, a dispatched request's booking, outcomes."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from epp.scheduling.types import EndpointState

FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"


class Outcome(enum.Enum):
    """How a request left the queue. Every request leaves it exactly once."""

    DISPATCHED = "dispatched"
    EXPIRED = "expired"
    """Waited its band's TTL: answered 429."""
    REJECTED = "rejected"
    """Its band's queue (or the whole queue) was full: answered 429."""
    EVICTED = "evicted"
    """A sheddable request pushed out of a full queue by a higher band's request: answered 429."""
    CANCELLED = "cancelled"
    """Its client went away while it waited."""


@dataclass(slots=True)
class FlowRequest:
    """One request as flow control sees it. ``key`` is unique per request in the process."""

    key: int
    band: int
    """The request's priority; higher bands dispatch first, bands below 0 are sheddable."""
    flow: str
    """The tenant: the fairness id header, else the model."""
    tokens: int
    """What dispatching it books: prompt tokens plus the output expected."""
    received_at: float
    slo_ttft_ms: float | None = None
    prompt_tokens: int = 0
    """Of ``tokens``, the prompt's: also booked as prefill, from routing to the first token."""
    enqueued_at: float = 0.0
    seq: int = 0
    """Arrival order, assigned by the controller."""
    block_hashes: Sequence[int] = ()
    """The prompt's prefix blocks, as the pipeline's approximate prefix index names them (empty
    without one): what the detectors estimate each endpoint's cached share of the prompt from."""

    @property
    def sheddable(self) -> bool:
        return self.band < 0

    @property
    def slo_deadline(self) -> float:
        """When its first token is due; infinite without a TTFT objective."""
        return math.inf if self.slo_ttft_ms is None else self.received_at + self.slo_ttft_ms / 1e3


@dataclass(frozen=True, slots=True)
class Decision:
    request: FlowRequest
    outcome: Outcome
    at: float
    endpoints: frozenset[str] | None = None
    """Dispatched: the endpoints the request fits (the pick must choose among them); None: any."""

    @property
    def queue_time_s(self) -> float:
        return self.at - self.request.enqueued_at


@dataclass(slots=True)
class Booking:
    """A dispatched request that has not finished: what the pool still owes it."""

    tokens: int
    dispatched_at: float
    prefill_tokens: int = 0
    """The prompt tokens still to prefill (the uncached ones, once routed): 0 once its first token came."""
    endpoint: str | None = None
    """None between dispatch and the pick (the request is on its way to the scheduler)."""
    routed_at: float | None = None


@dataclass(slots=True)
class PoolView:
    """What a saturation detector may read: the endpoints as scraped, and the EPP's own bookings
    of requests it dispatched (known at once, unlike the next scrape)."""

    now: float
    endpoints: Sequence[EndpointState]
    booked_tokens: Mapping[str, int]
    """Per endpoint, tokens booked by routed requests that have not finished."""
    routed_at: Mapping[str, Mapping[int, float]]
    """Per endpoint, when each of its unfinished routed requests (by key) was routed."""
    pending_requests: int = 0
    """Dispatched and not routed yet (their endpoint is still unknown)."""
    pending_tokens: int = 0
    prefill_tokens: Mapping[str, int] = field(default_factory=dict)
    """Per endpoint, prompt tokens of routed requests that have no first token yet."""
    peer_tokens: Mapping[str, int] = field(default_factory=dict)
    """Per endpoint, tokens other EPP replicas have in flight there (active-active sync)."""
    peer_prefill_tokens: Mapping[str, int] = field(default_factory=dict)
    """Per endpoint, other EPP replicas' prompt tokens there still to prefill."""
    replicas: int = 1
    """EPP replicas whose bookings ``peer_tokens`` holds, this one included."""
    cached_tokens: Callable[[FlowRequest], Mapping[str, int]] | None = None
    """Per endpoint, how many of a request's prompt tokens are likely cached there (None: no
    estimate, the whole prompt is to prefill everywhere)."""

    def uncached_tokens(self, request: FlowRequest, endpoints: Collection[str]) -> dict[str, int]:
        """Per endpoint of ``endpoints``, the prompt tokens ``request`` would prefill there."""
        cached = {} if self.cached_tokens is None else self.cached_tokens(request)
        return {name: request.prompt_tokens - cached.get(name, 0) for name in endpoints}

    def prefill_in_flight(self, endpoint: str) -> int:
        """Prompt tokens routed to ``endpoint`` still to prefill, by this replica and its peers."""
        return self.prefill_tokens.get(endpoint, 0) + self.peer_prefill_tokens.get(endpoint, 0)

    def routed_since(self, endpoint: str, since: float) -> int:
        """Unfinished requests routed to ``endpoint`` after ``since`` (a scrape's time)."""
        return sum(1 for at in self.routed_at.get(endpoint, {}).values() if at > since)
