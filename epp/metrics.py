"""The EPP's request metrics, and the helpers every metrics module of the EPP shares.

Each consumer owns its metrics: the director's request metrics are here
(:class:`RequestMetrics`); the data layer's are in ``epp.datalayer.metrics``, the latency
predictor's in ``epp.latency.metrics``, the replica sync's in ``epp.sync.metrics``. All register
in one registry per EPP instance (a fresh one per instance in tests).

Names follow the Gateway API Inference Extension (``inference_objective_*``,
``inference_pool_*``, ``inference_extension_*``) so existing dashboards work. Model names
come from clients, so the label is capped (:class:`ModelLabels`): past ``MAX_MODEL_LABELS``
distinct names, new ones are counted under ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.tokenizer.cache import TokenizerCache

MAX_MODEL_LABELS = 100
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (
    0.005,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    1.25,
    1.5,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    15,
    20,
    30,
    45,
    60,
    120,
    180,
    240,
    300,
    360,
    480,
    600,
    900,
    1200,
    1800,
    2700,
    3600,
)
TPOT_BUCKETS = (
    0.0005,
    0.00205,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.125,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.8,
    1.0,
    1.5,
    2,
    3,
    4.5,
    6,
    12,
    18,
    24,
    30,
    36,
    48,
    60,
    120,
    180,
    240,
    300,
    360,
    480,
    600,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072, 262144)
SCHEDULER_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


class TokenizerCacheCollector(Collector):
    """The tokenizer cache's counts and size, read at scrape time."""

    def __init__(self, pool: str, cache: TokenizerCache) -> None:
        self.pool, self.cache = pool, cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.cache.stats()
        counters = [
            ("hits", "Prompts whose token ids were partly or wholly reused from the cache", stats.hits),
            ("misses", "Prompts that share no cached text, tokenized whole", stats.misses),
            (
                "fallbacks",
                "Prompts that share cached text but were tokenized whole: no cut could be verified",
                stats.fallbacks,
            ),
            (
                "cut_failures",
                "Cuts whose overlap did not tokenize as cached (each also a fallback; a bug if counted)",
                stats.cut_failures,
            ),
            ("tokens_reused", "Token ids taken from the cache instead of tokenizing", stats.tokens_reused),
            ("verified", "Reused results checked against a full tokenization (verify mode)", stats.verified),
            (
                "mismatches",
                "Reused results that differed from a full tokenization (verify mode)",
                stats.mismatches,
            ),
        ]
        for name, help_text, value in counters:
            family = CounterMetricFamily(f"llm_epp_tokenizer_cache_{name}", help_text, labels=["name"])
            family.add_metric([self.pool], value)
            yield family
        for name, help_text, value in (
            ("bytes", "Estimated memory of the tokenizer cache", stats.bytes),
            ("entries", "Prompts held by the tokenizer cache", stats.entries),
        ):
            family = GaugeMetricFamily(f"llm_epp_tokenizer_cache_{name}", help_text, labels=["name"])
            family.add_metric([self.pool], value)
            yield family


class ModelLabels:
    """The model label of each client-supplied model name, capped at ``MAX_MODEL_LABELS`` names.
    Shared by every metrics object with a model label, so they agree on which names are ``other``."""

    def __init__(self) -> None:
        self._known: set[str] = set()

    def label(self, model: str) -> str:
        if model in self._known:
            return model
        if len(self._known) >= MAX_MODEL_LABELS:
            return "other"
        self._known.add(model)
        return model


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """The per-model children of the request metrics, resolved once per model (labels are slow)."""

    label: str
    requests: Counter
    duration: Histogram
    ttft: Histogram
    tpot: Histogram
    input_tokens: Histogram
    output_tokens: Histogram
    running: Gauge
    ttft_slo_violations: Counter
    tpot_slo_violations: Counter


class RequestMetrics:
    """What the director measures of the requests it routes."""

    def __init__(self, registry: CollectorRegistry, labels: ModelLabels) -> None:
        self.labels = labels
        model = ["model_name", "target_model_name"]
        self.requests = Counter("inference_objective_request", "Requests received", model, registry=registry)
        self.errors = Counter(
            "inference_objective_request_error",
            "Requests that failed",
            [*model, "error_code"],
            registry=registry,
        )
        self.duration = Histogram(
            "inference_objective_request_duration_seconds",
            "End-to-end request latency seen by the EPP",
            model,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "inference_objective_request_ttft_seconds",
            "Time to first token (streaming requests)",
            model,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "inference_objective_request_tpot_seconds",
            "Time per output token after the first (streaming)",
            model,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            "Prompt tokens per request",
            model,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            "Generated tokens per request",
            model,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.running = Gauge(
            "inference_objective_running_requests",
            "Requests in flight",
            ["model_name"],
            registry=registry,
        )
        self.scheduling = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time to pick an endpoint for a request",
            buckets=SCHEDULER_BUCKETS,
            registry=registry,
        )
        self.ttft_slo_violations = Counter(
            "inference_objective_request_ttft_slo_violation",
            "Requests whose TTFT exceeded their x-slo-ttft-ms",
            model,
            registry=registry,
        )
        self.tpot_slo_violations = Counter(
            "inference_objective_request_tpot_slo_violation",
            "Streaming requests whose TPOT exceeded their x-slo-tpot-ms",
            model,
            registry=registry,
        )
        self.upstream_failures = Counter(
            "llm_epp_upstream_failures",
            "Responses showing the endpoint failed (5xx or reset)",
            ["model_server_pod"],
            registry=registry,
        )
        self.access_log_entries = Counter(
            "llm_epp_access_log_entries",
            "Gateway access-log entries received (kind: final, intermediate, or unknown: for a "
            "request this EPP did not hand off)",
            ["kind"],
            registry=registry,
        )
        self.access_log_lag = Histogram(
            "llm_epp_access_log_lag_seconds",
            "From a handed-off request's last upstream byte to the EPP finishing it from its log entry",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.handed_off = Gauge(
            "llm_epp_handed_off_requests",
            "Streamed requests metered to their first token, waiting for their access-log entry",
            registry=registry,
        )
        self.handed_off_expired = Counter(
            "llm_epp_handed_off_expired",
            "Handed-off requests finished unheard: no access-log entry within --completion-log-silence-s",
            registry=registry,
        )
        self._series: dict[str, ModelSeries] = {}

    def for_model(self, model: str) -> ModelSeries:
        """Series for ``model`` (the shared ``other`` series past the label cap)."""
        series = self._series.get(model)
        if series is not None:
            return series
        label = self.labels.label(model)
        series = self._series.get(label)
        if series is None:
            series = ModelSeries(
                label,
                self.requests.labels(label, label),
                self.duration.labels(label, label),
                self.ttft.labels(label, label),
                self.tpot.labels(label, label),
                self.input_tokens.labels(label, label),
                self.output_tokens.labels(label, label),
                self.running.labels(label),
                self.ttft_slo_violations.labels(label, label),
                self.tpot_slo_violations.labels(label, label),
            )
            self._series[label] = series
        return series

    def error(self, series: ModelSeries | None, code: str) -> None:
        label = series.label if series else ""
        self.errors.labels(label, label, code).inc()
