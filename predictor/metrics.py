"""The prediction server's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PredictorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "predictor_calls_total",
            "Prediction calls by endpoint (strict, bulk) and outcome (ok, invalid, unavailable)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.rows = Counter("predictor_rows_total", "Rows predicted", registry=r)
        self.duration = Histogram(
            "predictor_call_duration_seconds",
            "Time from the request reaching the handler to the response built, per successful call",
            buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5),
            registry=r,
        )
        self.model_loads = Counter(
            "predictor_model_loads_total", "Model versions loaded and swapped in", registry=r
        )
        self.load_failures = Counter(
            "predictor_model_load_failures_total",
            "Attempts to load a model version that failed, by reason; the last good version kept serving",
            ["reason"],
            registry=r,
        )
        self.model_version = Gauge(
            "predictor_model_version", "Version of the models being served", registry=r
        )
