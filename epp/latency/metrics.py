"""The latency predictor's Prometheus metrics: the predictor client's calls and training rows,
and the prediction report's predicted latencies and fallbacks (``epp.latency.report``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from epp.metrics import LATENCY_BUCKETS, SCHEDULER_BUCKETS, TPOT_BUCKETS, ModelLabels


class PredictionMetrics:
    def __init__(self, registry: CollectorRegistry, labels: ModelLabels) -> None:
        self.labels = labels
        model = ["model_name", "target_model_name"]
        self.prediction_duration = Histogram(
            "llm_epp_prediction_call_duration_seconds",
            "Latency of one coalesced bulk call to a predictor",
            buckets=SCHEDULER_BUCKETS,
            registry=registry,
        )
        self.prediction_batch_rows = Histogram(
            "llm_epp_prediction_batch_rows",
            "Feature rows per coalesced predictor call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 10000),
            registry=registry,
        )
        self.prediction_batch_requests = Histogram(
            "llm_epp_prediction_batch_requests",
            "Scheduling requests coalesced into one predictor call",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=registry,
        )
        self.prediction_fallbacks = Counter(
            "llm_epp_prediction_fallback",
            "Requests scheduled without predictions, by reason",
            ["reason"],
            registry=registry,
        )
        self.training_rows = Counter(
            "llm_epp_training_rows",
            "Training samples sent to the trainer or dropped",
            ["outcome"],
            registry=registry,
        )
        self.predicted_ttft = Histogram(
            "inference_objective_request_predicted_ttft_seconds",
            "Predicted time to first token on the chosen endpoint",
            model,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.predicted_tpot = Histogram(
            "inference_objective_request_predicted_tpot_seconds",
            "Predicted time per output token on the chosen endpoint",
            model,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )

    def observe_predicted(self, model: str, ttft_s: float, tpot_s: float) -> None:
        """The chosen endpoint's prediction for a completed request of ``model``."""
        label = self.labels.label(model)
        self.predicted_ttft.labels(label, label).observe(ttft_s)
        self.predicted_tpot.labels(label, label).observe(tpot_s)
