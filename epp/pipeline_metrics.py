"""The scheduling pipeline's own metric: ``llm_epp_producer_failures_total{plugin}``.

A producer that raises is skipped and its consumers fall back (``Pipeline.schedule``), so
routing goes on quietly degraded; this counter is how an operator sees it. It is read from
``Pipeline.producer_failures`` at scrape time, which keeps the scheduling core free of metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.scheduling.pipeline import Pipeline


class _ProducerFailures(Collector):
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "llm_epp_producer_failures",
            "Exceptions raised by a data producer; the request was routed without its data.",
            labels=["plugin"],
        )
        for producer in self.pipeline.producers:
            family.add_metric([producer.name], self.pipeline.producer_failures[producer.name])
        yield family


def export_producer_failures(registry: CollectorRegistry, pipeline: Pipeline) -> None:
    """Export ``pipeline``'s producer failures on ``registry``, one series per producer."""
    registry.register(_ProducerFailures(pipeline))
