"""The training server's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_REASONS = {
    "missing": "missing_field",
    "extra_forbidden": "unknown_field",
    "finite_number": "not_finite",
    "greater_than_equal": "out_of_range",
    "less_than_equal": "out_of_range",
}


def rejection_reason(error_type: str) -> str:
    """The ``reason`` label of a sample pydantic rejected with ``error_type``: a wrong type unless
    it is one of the few named cases."""
    return _REASONS.get(error_type, "wrong_type")


class TrainerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = Counter(
            "trainer_samples_total",
            "Accepted training samples by the window they went to (unused: no latency measured)",
            ["destination"],
            registry=r,
        )
        self.rejected_samples = Counter(
            "trainer_rejected_samples_total",
            "Training samples refused, by reason (batch_rejected: valid, in a batch with a bad one)",
            ["reason"],
            registry=r,
        )
        self.rejected_requests = Counter(
            "trainer_rejected_requests_total",
            "Bulk requests refused, by reason",
            ["reason"],
            registry=r,
        )
        self.window_samples = Gauge(
            "trainer_window_samples", "Samples held in the model's window", ["model"], registry=r
        )
        self.training_samples = Gauge(
            "trainer_model_training_samples", "Samples the current model was fitted on", ["model"], registry=r
        )
        self.mape = Gauge(
            "trainer_model_mape", "Holdout MAPE of the current mean model", ["model"], registry=r
        )
        self.pinball_loss = Gauge(
            "trainer_model_pinball_loss",
            "Holdout pinball loss (ms) of the current quantile model",
            ["model"],
            registry=r,
        )
        self.coverage = Gauge(
            "trainer_model_coverage",
            "Holdout share of actuals at or below the current quantile model's prediction",
            ["model"],
            registry=r,
        )
        self.retrain_duration = Histogram(
            "trainer_retrain_duration_seconds",
            "Time to fit and evaluate one model",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.withheld_models = Counter(
            "trainer_models_withheld",
            "Fitted models not published: no better than a constant on their holdout",
            ["model"],
            registry=r,
        )
        self.retrain_failures = Counter(
            "trainer_retrain_failures_total", "Retraining rounds that failed", registry=r
        )
        self.model_version = Gauge("trainer_model_version", "Version of the published models", registry=r)
        self.holdout_error = Gauge(
            "trainer_model_version_holdout_error",
            "Holdout loss of each model version written and kept (MAPE for mean models, pinball "
            "loss in ms for quantile models)",
            ["model", "version"],
            registry=r,
        )
        self.retrain_requests = Counter(
            "trainer_retrain_requests_total",
            "Retrains asked for by an EPP whose predictions drifted",
            registry=r,
        )
        self._versions: dict[str, list[int]] = {}

    def version_holdout_error(self, model: str, version: int, loss: float | None, keep: int) -> None:
        """The holdout loss of ``model``'s version ``version`` (the version that trained it);
        only the ``keep`` newest versions of a model keep their series."""
        versions = self._versions.setdefault(model, [])
        if loss is None or version in versions:
            return
        self.holdout_error.labels(model, str(version)).set(loss)
        versions.append(version)
        versions.sort()
        while len(versions) > keep:
            self.holdout_error.remove(model, str(versions.pop(0)))
