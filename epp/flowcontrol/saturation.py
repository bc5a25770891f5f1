"""Saturation detectors: whether the pool has room for the request at the head of the queue.

Each looks at every endpoint on its own (an average hides one hot pod: the pool has room when
some endpoint has), and counts what the EPP dispatched since the engines last reported, so it
does not overshoot between scrapes. With several detectors configured the pool is saturated
when any of them says so.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pydantic import Field

from epp.flowcontrol.types import FlowRequest, PoolView
from epp.latency.predictions import LATENCY_PREDICTIONS
from epp.scheduling.framework import CycleState, Plugin, PluginContext, PluginParameters
from epp.scheduling.registry import register


class SaturationDetector(Plugin, ABC):
    @abstractmethod
    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        """True when dispatching ``head`` now would only queue it in an engine."""

    def routed(self, endpoint: str, state: CycleState, now: float) -> None:
        """A dispatched request was routed to ``endpoint`` (``state`` holds its cycle's data)."""


class QueueKvParameters(PluginParameters):
    queue_depth_threshold: int = Field(default=5, ge=1, alias="queueDepthThreshold")
    kv_cache_util_threshold: float = Field(default=0.8, gt=0, le=1, alias="kvCacheUtilThreshold")
    metrics_staleness_seconds: float = Field(default=0.2, gt=0, alias="metricsStalenessSeconds")


@register
class QueueKvSaturationDetector(SaturationDetector):
    """Room while some endpoint with fresh metrics is below both thresholds. An endpoint's queue
    is its scraped waiting count plus the requests routed there since that scrape; the room is
    the sum over endpoints of queue slots left, less the requests dispatched and not yet routed."""

    type_name = "queue-kv-saturation-detector"
    Parameters = QueueKvParameters
    params: QueueKvParameters

    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        p = self.params
        slots = 0
        for e in pool.endpoints:
            m = e.metrics
            if m.age(pool.now) > p.metrics_staleness_seconds or m.kv_cache_usage >= p.kv_cache_util_threshold:
                continue
            queued = m.waiting + pool.routed_since(e.name, m.updated_at)
            slots += max(0, p.queue_depth_threshold - queued)
        return slots <= pool.pending_requests


class TokenLoadParameters(PluginParameters):
    max_tokens_per_endpoint: int = Field(default=200_000, ge=1, alias="maxTokensPerEndpoint")
    max_prefill_tokens_per_endpoint: int | None = Field(
        default=None, ge=1, alias="maxPrefillTokensPerEndpoint"
    )
    """Prompt tokens an endpoint may have waiting for their first token (None: no such limit).
    About one engine step's token budget keeps a short prompt from queueing in the engine behind
    several long ones: it waits in the EPP instead, where fairness can put it first."""


@register
class TokenLoadSaturationDetector(SaturationDetector):
    """The EPP's own in-flight token load, booked at dispatch (prompt plus expected output) and
    released when the request finishes, so it is exact between scrapes. Room while the endpoints'
    headroom (each endpoint's capacity less its bookings, never below zero) covers the head
    request and those on their way; an idle pool always takes one, however large. Peer replicas'
    bookings count too when the replicas share token load; then a replica also has room while its
    own bookings leave headroom in its share of the capacity (1/K of it, ``PoolView.replicas``):
    fairness is per replica, and without a share a peer's fresh arrivals would take every bit of
    room that frees up while this replica's waiting requests expire. With ``maxPrefillTokensPerEndpoint``,
    also saturated unless some endpoint has room for the head's prompt among the prompt tokens
    routed there and not yet answered, peers' too (an endpoint without any always has); while a dispatched
    request is on its way to the pick (its endpoint still unknown), none has."""

    type_name = "token-load-saturation-detector"
    Parameters = TokenLoadParameters
    params: TokenLoadParameters

    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        cap = self.params.max_tokens_per_endpoint
        share = cap // pool.replicas
        headroom = own_headroom = 0
        busy = pool.pending_requests > 0
        for e in pool.endpoints:
            own = pool.booked_tokens.get(e.name, 0)
            booked = own + pool.peer_tokens.get(e.name, 0)
            busy = busy or booked > 0
            headroom += max(0, cap - booked)
            own_headroom += max(0, share - own)
        if busy and max(headroom, own_headroom) - pool.pending_tokens < head.tokens:
            return True
        return not self._prefill_room(pool, head)

    def _prefill_room(self, pool: PoolView, head: FlowRequest) -> bool:
        cap = self.params.max_prefill_tokens_per_endpoint
        if cap is None or pool.pending_requests > 0:
            return cap is None
        return any(
            (prefill := pool.prefill_tokens.get(e.name, 0) + pool.peer_prefill_tokens.get(e.name, 0)) == 0
            or prefill + head.prompt_tokens <= cap
            for e in pool.endpoints
        )


class PredictedTtftParameters(PluginParameters):
    default_slo_ttft_ms: float = Field(default=2000.0, gt=0, alias="defaultSloTtftMs")
    """The objective for requests that carry none."""
    max_age_seconds: float = Field(default=1.0, gt=0, alias="maxAgeSeconds")


@register
class PredictedTtftSaturationDetector(SaturationDetector):
    """Saturated when no endpoint is predicted to meet the head request's TTFT objective.

    The predictions are those the latency predictor made for the last request routed (any
    endpoint's latest, from the pipeline's ``latency-predictions``), less the time they have
    since waited; a prediction older than ``maxAgeSeconds`` is no evidence, and an endpoint
    without fresh evidence counts as room, so one request probes it and refreshes the picture.
    Needs a ``predicted-latency-producer`` in the pipeline; without one it never saturates."""

    type_name = "predicted-ttft-saturation-detector"
    Parameters = PredictedTtftParameters
    params: PredictedTtftParameters

    def __init__(self, name: str, params: PredictedTtftParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._latest: dict[str, tuple[float, float]] = {}
        """Endpoint → (predicted TTFT ms, when predicted)."""

    def routed(self, endpoint: str, state: CycleState, now: float) -> None:
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None:
            return
        for name, predicted in predictions.by_endpoint.items():
            self._latest[name] = (predicted.ttft_ms, now)

    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        slo = head.slo_ttft_ms if head.slo_ttft_ms is not None else self.params.default_slo_ttft_ms
        budget = slo - (pool.now - head.received_at) * 1e3
        for e in pool.endpoints:
            latest = self._latest.get(e.name)
            if latest is None or pool.now - latest[1] > self.params.max_age_seconds:
                return False
            if latest[0] <= budget:
                return False
        return bool(pool.endpoints)
