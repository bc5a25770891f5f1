"""A producer that raises is skipped, and counted by plugin name where an operator can see it."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from epp.pipeline_metrics import export_producer_failures
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import CycleState, PluginContext
from tests.epp.factories import FakeClock, endpoint_state, make_request, run

CONFIG = """
plugins:
- {name: prefix, type: approximate-prefix-cache-producer}
- {name: prefix-scorer, type: prefix-cache-scorer}
- {name: picker, type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-scorer}, {pluginRef: picker}]
"""


def test_a_failing_producer_is_counted_under_its_name_and_routing_goes_on(monkeypatch) -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1))
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(CONFIG), context)
    registry = CollectorRegistry()
    export_producer_failures(registry, pipeline)
    assert registry.get_sample_value("llm_epp_producer_failures_total", {"plugin": "prefix"}) == 0

    def broken(*args: object) -> None:
        raise RuntimeError("producer bug")

    monkeypatch.setattr(ApproximatePrefixCacheProducer, "produce", broken)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    for _ in range(2):
        result = run(pipeline.schedule(make_request(list(range(64))), endpoints, CycleState()))
        assert result.endpoint.name in {"e0", "e1"}
    assert registry.get_sample_value("llm_epp_producer_failures_total", {"plugin": "prefix"}) == 2
