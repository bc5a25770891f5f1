"""Fakes and builders for the predicted-latency producer and what reads its predictions."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from epp.plugins.predicted_latency import PredictedLatencyParameters, PredictedLatencyProducer
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.predictor import Prediction
from tests.epp.factories import FakeClock, FakePredictor, make_request, run


def producer(predictor: FakePredictor, **params: Any) -> PredictedLatencyProducer:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1), wall_clock=lambda: 1.7e9,
                            latency_predictor=predictor)  # fmt: skip
    return PredictedLatencyProducer("p", PredictedLatencyParameters(**params), context)


def produce(plugin: PredictedLatencyProducer, request, endpoints) -> CycleState:
    state = CycleState()
    pending = plugin.produce(request, endpoints, state)
    if pending is not None:
        run(pending)
    return state


def streaming_request(**kw: Any):
    request = make_request(list(range(50)))
    request.stream = True
    for k, v in kw.items():
        setattr(request, k, v)
    return request


class VersionedPredictor:
    """Predicts 100 ms TTFT / 10 ms TPOT with model version 3; counts retrain requests."""

    def __init__(self) -> None:
        self.retrains = 0
        self.samples: list[dict[str, Any]] = []

    async def predict(self, rows: Sequence[dict[str, Any]]) -> list[Prediction]:
        return [Prediction(100.0, 10.0, 3) for _ in rows]

    def add_training(self, samples: Sequence[dict[str, Any]]) -> None:
        self.samples.extend(samples)

    def request_retrain(self) -> None:
        self.retrains += 1


class ConstantTpotPredictor(VersionedPredictor):
    """As :class:`VersionedPredictor`, its TPOT model a constant (no trees)."""

    async def predict(self, rows: Sequence[dict[str, Any]]) -> list[Prediction]:
        return [Prediction(100.0, 10.0, 3, ("tpot",)) for _ in rows]


DECISION_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: predicted-latency-producer
  parameters: {streamingMode: true}
- type: slo-headroom-tier-filter
  parameters: {epsilonExploreNeg: 0}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: max-score-picker
"""
"""A predicted-latency profile whose decision trace has a filter, two weighted scorers and a picker."""


class QueuePredictor(VersionedPredictor):
    """TTFT 100 ms plus 100 ms per waiting request; model version 3."""

    async def predict(self, rows: Sequence[dict[str, Any]]) -> list[Prediction]:
        return [Prediction(100.0 + 100.0 * r["num_request_waiting"], 10.0, 3) for r in rows]
