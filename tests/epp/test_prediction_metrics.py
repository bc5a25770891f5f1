"""The prediction report's metrics: per-model predicted latencies (capped labels) and fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.latency.metrics import PredictionMetrics
from epp.metrics import MAX_MODEL_LABELS, ModelLabels


def test_predicted_latencies_count_per_model_and_past_the_cap_as_other() -> None:
    registry = CollectorRegistry()
    metrics = PredictionMetrics(registry, ModelLabels())
    for i in range(MAX_MODEL_LABELS + 2):
        metrics.observe_predicted(f"m{i}", 0.1, 0.01)
    metrics.observe_predicted("m0", 0.3, 0.02)

    def sample(name: str, model: str) -> float | None:
        labels = {"model_name": model, "target_model_name": model}
        return registry.get_sample_value(f"inference_objective_request_predicted_{name}", labels)

    assert sample("ttft_seconds_count", "m0") == 2 and sample("ttft_seconds_sum", "m0") == 0.4
    assert sample("tpot_seconds_sum", "m0") == 0.03
    assert sample("ttft_seconds_count", "other") == 2
    assert sample("ttft_seconds_count", f"m{MAX_MODEL_LABELS}") is None


def test_fallbacks_count_by_reason() -> None:
    registry = CollectorRegistry()
    metrics = PredictionMetrics(registry, ModelLabels())
    for reason in ("unavailable", "warmup", "unavailable"):
        metrics.count_fallback(reason)
    value = registry.get_sample_value
    assert value("llm_epp_prediction_fallback_total", {"reason": "unavailable"}) == 2
    assert value("llm_epp_prediction_fallback_total", {"reason": "warmup"}) == 1
