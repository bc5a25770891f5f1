"""The latency predictor's Prometheus metrics: the predictor client's calls and training rows,
the prediction report's predicted latencies and fallbacks (``epp.latency.report``), and the
live prediction error and drift state (``epp.latency.drift``, :class:`DriftCollector`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.latency.drift import DriftMonitor
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
        # Labelled children, resolved once per label value (``labels()`` is slow per request).
        self._predicted: dict[str, tuple[Histogram, Histogram]] = {}
        self._fallbacks: dict[str, Counter] = {}

    def observe_predicted(self, model: str, ttft_s: float, tpot_s: float) -> None:
        """The chosen endpoint's prediction for a completed request of ``model``."""
        children = self._predicted.get(model)
        if children is None:  # kept by label, so that the dict is bounded like the labels
            label = self.labels.label(model)
            children = self._predicted.get(label)
            if children is None:
                children = self._predicted[label] = (
                    self.predicted_ttft.labels(label, label),
                    self.predicted_tpot.labels(label, label),
                )
        ttft, tpot = children
        ttft.observe(ttft_s)
        tpot.observe(tpot_s)

    def count_fallback(self, reason: str) -> None:
        """A request scheduled without predictions, for ``reason`` (a small fixed set)."""
        child = self._fallbacks.get(reason)
        if child is None:
            child = self._fallbacks[reason] = self.prediction_fallbacks.labels(reason)
        child.inc()


class DriftCollector(Collector):
    """The drift monitor's state at each scrape: rolling MAPE and bias per target and model
    version on the chosen endpoints, whether the model drifts, and how often it started to."""

    def __init__(self, monitor: DriftMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        labels = ["target", "model_version"]
        mape = GaugeMetricFamily(
            "llm_epp_prediction_mape",
            "Rolling mean absolute percentage error of the chosen endpoint's prediction (1 = 100%)",
            labels=labels,
        )
        bias = GaugeMetricFamily(
            "llm_epp_prediction_bias",
            "Rolling mean of (predicted - actual) / actual on the chosen endpoint (> 0: predicts too slow)",
            labels=labels,
        )
        for stats in self.monitor.stats():
            mape.add_metric([stats.target, str(stats.version)], stats.mape)
            bias.add_metric([stats.target, str(stats.version)], stats.bias)
        yield mape
        yield bias
        yield GaugeMetricFamily(
            "llm_epp_prediction_drifting",
            "1 while the newest model's live error is over the drift threshold (requests fall back)",
            value=float(self.monitor.drifting),
        )
        yield CounterMetricFamily(
            "llm_epp_prediction_drift_episodes",
            "Times the live prediction error went over the drift threshold",
            value=sum(1 for e in self.monitor.events if e.drifting),
        )
