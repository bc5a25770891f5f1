"""Prometheus metrics of flow control, per band and flow.

Queue sizes and the saturation state are read from the controller when Prometheus scrapes, so
a request that leaves the queue (cancelled included) leaves the gauge at once. Flow names come
from clients, so past ``MAX_FLOW_LABELS`` distinct flows new ones are counted as ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.flowcontrol.controller import FlowController
from epp.flowcontrol.types import Decision
from epp.metrics import LATENCY_BUCKETS

MAX_FLOW_LABELS = 100


class _QueueCollector(Collector):
    def __init__(self, pool: str, controller: FlowController, metrics: FlowMetrics) -> None:
        self.pool, self.controller, self.metrics = pool, controller, metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in flow control",
            labels=["inference_pool", "priority", "fairness_id"],
        )
        totals: dict[tuple[str, str], int] = {}
        for (band, flow), n in self.controller.queue_sizes().items():
            labels = (str(band), self.metrics.flow_label(flow))
            totals[labels] = totals.get(labels, 0) + n
        for labels, n in totals.items():
            size.add_metric([self.pool, *labels], n)
        yield size
        saturated = GaugeMetricFamily(
            "inference_extension_flow_control_pool_saturated",
            "1 while the saturation detectors hold requests back",
            labels=["inference_pool"],
        )
        saturated.add_metric([self.pool], 1.0 if self.controller.saturated and len(self.controller) else 0.0)
        yield saturated


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, pool: str, controller: FlowController) -> None:
        self.pool = pool
        self._flows: set[str] = set()
        labels = ["inference_pool", "priority", "fairness_id", "outcome"]
        self.requests = Counter(
            "inference_extension_flow_control_requests",
            "Requests that left flow control, by outcome (dispatched, expired, rejected, evicted, cancelled)",
            labels,
            registry=registry,
        )
        self.queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests waited in flow control, by outcome",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_QueueCollector(pool, controller, self))

    def flow_label(self, flow: str) -> str:
        if flow not in self._flows and len(self._flows) >= MAX_FLOW_LABELS:
            return "other"
        self._flows.add(flow)
        return flow

    def record(self, decision: Decision) -> None:
        r = decision.request
        labels = (self.pool, str(r.band), self.flow_label(r.flow), decision.outcome.value)
        self.requests.labels(*labels).inc()
        self.queue_duration.labels(*labels).observe(decision.queue_time_s)
