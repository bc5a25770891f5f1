"""Saturation detectors: whether the pool has room for the request at the head of the queue.

Each looks at every endpoint on its own (an average hides one hot pod: the pool has room when
some endpoint has), and counts what the EPP dispatched since the engines last reported, so it
does not overshoot between scrapes. With several detectors configured the pool is saturated
when any of them says so.

===========================  =======  ============================================================
parameter                    default  meaning
===========================  =======  ============================================================
queueDepthThreshold          5        ``queue-kv-saturation-detector``: queue slots per endpoint
                                      (scraped waiting + routed since that scrape)
kvCacheUtilThreshold         0.8      ``queue-kv-saturation-detector``: KV-cache usage at which an
                                      endpoint has no room
metricsStalenessSeconds      0.2      ``queue-kv-saturation-detector``: older metrics count as no
                                      room (flow control has such endpoints scraped at once)
maxTokensPerEndpoint         200000   ``token-load-saturation-detector``: tokens booked per
                                      endpoint (prompt + expected output) it takes at most
maxPrefillTokensPerEndpoint  none     ``token-load-saturation-detector``: prompt tokens without a
                                      first token yet per endpoint (about one engine step's
                                      ``max_num_batched_tokens``); the pick is held to endpoints
                                      the request fits
isolatedPrefillTokens        none     ``token-load-saturation-detector``, with the prefill limit
                                      and 2+ endpoints: keep some endpoint's prefill in flight
                                      within this, for requests with a TTFT objective
defaultSloTtftMs             2000     ``predicted-ttft-saturation-detector``: the TTFT objective
                                      of a request without one
maxAgeSeconds                1        ``predicted-ttft-saturation-detector``: older predictions
                                      count as room
===========================  =======  ============================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pydantic import Field

from epp.flowcontrol.types import FlowRequest, PoolView
from epp.scheduling.framework import CycleState, Plugin, PluginContext, PluginParameters
from epp.scheduling.predictions import LATENCY_PREDICTIONS
from epp.scheduling.registry import register


class SaturationDetector(Plugin, ABC):
    @abstractmethod
    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        """True when dispatching ``head`` now would only queue it in an engine."""

    def endpoints(self, pool: PoolView, head: FlowRequest) -> frozenset[str] | None:
        """The endpoints ``head`` fits when it fits only some: dispatched, it is picked among
        them. None: any endpoint; empty: none (it waits). Asked only when not :meth:`saturated`."""
        return None

    def uses_prefix_estimate(self) -> bool:
        """Whether :meth:`endpoints` reads ``PoolView.cached_tokens`` (requests then carry their
        prefix blocks)."""
        return False

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
    isolated_prefill_tokens: int | None = Field(default=None, ge=1, alias="isolatedPrefillTokens")
    """Prefill isolation (needs ``maxPrefillTokensPerEndpoint`` and two endpoints or more): keep
    some endpoint with at most this many prompt tokens waiting for their first token, for
    requests with a TTFT objective, which go only where they keep within it. None: off."""


@register
class TokenLoadSaturationDetector(SaturationDetector):
    """The EPP's own in-flight token load, booked at dispatch (prompt plus expected output) and
    released when the request finishes, so it is exact between scrapes. Room while the endpoints'
    headroom (each endpoint's capacity less its bookings, never below zero) covers the head
    request and those on their way; an idle pool always takes one, however large. Peer replicas'
    bookings count too when the replicas share token load; then a replica also has room while its
    own bookings leave headroom in its share of the capacity (1/K of it, ``PoolView.replicas``):
    fairness is per replica, and without a share a peer's fresh arrivals would take every bit of
    room that frees up while this replica's waiting requests expire.

    With ``maxPrefillTokensPerEndpoint`` the decision is per endpoint: the head fits an endpoint
    whose prompt tokens routed there and not yet answered (peers' too), plus the head's uncached
    tokens there (``PoolView.uncached_tokens``), stay within the limit (an endpoint without any
    always fits), and it is picked among those; while a dispatched request is on its way to the
    pick (its endpoint still unknown), none fits. With ``isolatedPrefillTokens`` as well, a
    request with a TTFT objective fits only where that sum stays within it (or the endpoint has
    none); one without fits an endpoint only while another endpoint is within it, or if this
    one stays within half of it (the other half is kept for requests with an objective). So
    some endpoint is always within it: long prefills take turns, and a short prompt with an
    objective never queues in an engine behind one."""

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
        return self.params.max_prefill_tokens_per_endpoint is not None and pool.pending_requests > 0

    def uses_prefix_estimate(self) -> bool:
        return self.params.max_prefill_tokens_per_endpoint is not None

    def endpoints(self, pool: PoolView, head: FlowRequest) -> frozenset[str] | None:
        cap = self.params.max_prefill_tokens_per_endpoint
        if cap is None:
            return None
        names = [e.name for e in pool.endpoints]
        added = pool.uncached_tokens(head, names)
        load = {name: pool.prefill_in_flight(name) for name in names}
        fits = {name for name in names if load[name] == 0 or load[name] + added[name] <= cap}
        isolated = self.params.isolated_prefill_tokens
        if isolated is None or len(names) < 2:
            return frozenset(fits)
        if head.slo_ttft_ms is not None:
            return frozenset(name for name in fits if load[name] == 0 or load[name] + added[name] <= isolated)
        clear = {name for name in names if load[name] <= isolated}
        return frozenset(name for name in fits if clear - {name} or load[name] + added[name] <= isolated // 2)


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
