"""The EPP's own Prometheus metrics.

Names follow the Gateway API Inference Extension (``inference_objective_*``,
``inference_pool_*``, ``inference_extension_*``) so existing dashboards work. Model names
come from clients, so the label is capped: past ``MAX_MODEL_LABELS`` distinct names, new
ones are counted under ``other``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.datalayer.endpoints import EndpointStore
from epp.kvcache.precise_index import PreciseIndex
from epp.load.token_load import TokenLoadTracker
from epp.tokenizer_cache import TokenizerCache

MAX_MODEL_LABELS = 100
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


class _PoolCollector(Collector):
    """Per-endpoint gauges read from the store at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, pool: str, store: EndpointStore, clock: Callable[[], float]) -> None:
        self.pool, self.store, self.clock = pool, store, clock
        self.token_load: TokenLoadTracker | None = None
        self.peers_token_load: TokenLoadTracker | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["name", "model_server_pod"]
        queue = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size", "Waiting requests per endpoint", labels=labels
        )
        kv = GaugeMetricFamily(
            "inference_pool_per_pod_kv_cache_utilization", "KV-cache usage per endpoint", labels=labels
        )
        running = GaugeMetricFamily(
            "inference_pool_per_pod_running_requests", "Running requests per endpoint", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "llm_epp_endpoint_in_flight_requests",
            "Requests routed by this EPP and not finished",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "llm_epp_endpoint_metrics_age_seconds",
            "Seconds since the endpoint's last good scrape",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "llm_epp_endpoint_healthy", "1 if the endpoint is a scheduling candidate", labels=labels
        )
        now = self.clock()
        states = self.store.all()
        for s in states:
            values = [self.pool, s.name]
            queue.add_metric(values, s.metrics.waiting)
            kv.add_metric(values, s.metrics.kv_cache_usage)
            running.add_metric(values, s.metrics.running)
            in_flight.add_metric(values, s.in_flight)
            age.add_metric(values, min(s.metrics.age(now), 1e9))
            healthy.add_metric(values, 1.0 if self.store.is_healthy(s.name) else 0.0)
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods", "Endpoints that are scheduling candidates", labels=["name"]
        )
        ready.add_metric([self.pool], len(self.store.candidates()))
        yield from (queue, kv, running, in_flight, age, healthy, ready)
        if self.token_load is not None:
            yield from self._token_load(self.token_load, [s.name for s in states])

    def _token_load(self, tracker: TokenLoadTracker, names: list[str]) -> Iterator[GaugeMetricFamily]:
        # "Routed by this EPP" includes, with replica sync, what its peers routed (as scoring sees it).
        labels = ["name", "model_server_pod"]
        prefill = GaugeMetricFamily(
            "llm_epp_endpoint_prefill_tokens_in_flight",
            "Uncached prompt tokens routed by this EPP (and its synced peers) and not yet prefilled",
            labels=labels,
        )
        decode = GaugeMetricFamily(
            "llm_epp_endpoint_decode_tokens_in_flight",
            "KV tokens (prompt + generated) of requests routed by this EPP (and its synced peers) "
            "that are decoding",
            labels=labels,
        )
        kv = GaugeMetricFamily(
            "llm_epp_endpoint_kv_tokens_in_flight",
            "KV tokens (prompt + generated) of every request routed by this EPP (and its synced peers) "
            "and not finished",
            labels=labels,
        )
        remaining = GaugeMetricFamily(
            "llm_epp_endpoint_expected_output_tokens_in_flight",
            "Output tokens still expected from requests routed by this EPP (and its synced peers; estimates)",
            labels=labels,
        )
        peers = self.peers_token_load
        for name in names:
            load = tracker.load(name) if peers is None else tracker.load(name) + peers.load(name)
            prefill.add_metric([self.pool, name], load.prefill_tokens)
            decode.add_metric([self.pool, name], load.decode_tokens)
            kv.add_metric([self.pool, name], load.kv_tokens)
            remaining.add_metric([self.pool, name], load.expected_remaining_tokens)
        yield from (prefill, decode, kv, remaining)


class _KVIndexCollector(Collector):
    """The precise prefix index per endpoint, read at scrape time."""

    def __init__(self, pool: str, store: EndpointStore, index: PreciseIndex) -> None:
        self.pool, self.store, self.index = pool, store, index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["name", "model_server_pod"]
        blocks = GaugeMetricFamily(
            "llm_epp_kv_index_blocks",
            "KV blocks the endpoint's engine holds, per its KV events",
            labels=labels,
        )
        stale = GaugeMetricFamily(
            "llm_epp_kv_events_stale",
            "1 when the endpoint has no KV-event source or its events went stale: its prefix "
            "match comes from the approximate index",
            labels=labels,
        )
        orphans = GaugeMetricFamily(
            "llm_epp_kv_index_orphan_stores",
            "Stored blocks whose parent the endpoint did not hold (a sign of missed KV events)",
            labels=labels,
        )
        for s in self.store.all():
            values = [self.pool, s.name]
            blocks.add_metric(values, self.index.blocks_held(s.name))
            stale.add_metric(values, 0.0 if self.index.is_live(s.name) else 1.0)
            orphans.add_metric(values, self.index.orphans(s.name))
        size = GaugeMetricFamily(
            "llm_epp_kv_index_bytes", "Memory of the precise prefix index's table", labels=["name"]
        )
        size.add_metric([self.pool], self.index.nbytes)
        yield from (blocks, stale, orphans, size)


class _TokenizerCacheCollector(Collector):
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
    predicted_ttft: Histogram
    predicted_tpot: Histogram
    ttft_slo_violations: Counter
    tpot_slo_violations: Counter


class EppMetrics:
    """All EPP metrics, registered in one registry (a fresh one per EPP instance in tests)."""

    def __init__(
        self, registry: CollectorRegistry, pool: str, store: EndpointStore, clock: Callable[[], float]
    ):
        self.registry = registry
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
        self.upstream_failures = Counter(
            "llm_epp_upstream_failures",
            "Responses showing the endpoint failed (5xx or reset)",
            ["model_server_pod"],
            registry=registry,
        )
        self.kv_events = Counter(
            "llm_epp_kv_events_received",
            "KV events received from engines, by type (invalid: undecodable batches)",
            ["model_server_pod", "type"],
            registry=registry,
        )
        self.kv_event_gaps = Counter(
            "llm_epp_kv_events_gaps",
            "Missed KV-event batches, by outcome (replayed: replay filled the gap; rebuilt: it "
            "could not, and the endpoint's entries were cleared and rebuilt; restarted: the "
            "publisher started over)",
            ["model_server_pod", "outcome"],
            registry=registry,
        )
        self.kv_event_fallbacks = Counter(
            "llm_epp_kv_events_fallback",
            "Times an endpoint's KV events went stale, so that its prefix match fell back to the "
            "approximate index",
            ["model_server_pod"],
            registry=registry,
        )
        self.pool = pool
        self.store = store
        self._pool = _PoolCollector(pool, store, clock)
        registry.register(self._pool)
        self._series: dict[str, ModelSeries] = {}

    def export_token_load(self, tracker: TokenLoadTracker, peers: TokenLoadTracker | None = None) -> None:
        """Export ``tracker``'s per-endpoint load (the pipeline's ``token-load-producer``), plus
        ``peers``' (the bookings synced from peer replicas) when given."""
        self._pool.token_load = tracker
        self._pool.peers_token_load = peers

    def track_kv_index(self, index: PreciseIndex) -> None:
        """Export ``index`` per endpoint (blocks, staleness) and its memory."""
        self.registry.register(_KVIndexCollector(self.pool, self.store, index))

    def track_tokenizer_cache(self, cache: TokenizerCache) -> None:
        """Export the tokenizer cache's hit counts and size."""
        self.registry.register(_TokenizerCacheCollector(self.pool, cache))

    def for_model(self, model: str) -> ModelSeries:
        """Series for ``model``; past ``MAX_MODEL_LABELS`` distinct models, the shared ``other`` series."""
        series = self._series.get(model)
        if series is not None:
            return series
        if len(self._series) >= MAX_MODEL_LABELS:
            model = "other"
            if (series := self._series.get(model)) is not None:
                return series
        series = ModelSeries(
            model,
            self.requests.labels(model, model),
            self.duration.labels(model, model),
            self.ttft.labels(model, model),
            self.tpot.labels(model, model),
            self.input_tokens.labels(model, model),
            self.output_tokens.labels(model, model),
            self.running.labels(model),
            self.predicted_ttft.labels(model, model),
            self.predicted_tpot.labels(model, model),
            self.ttft_slo_violations.labels(model, model),
            self.tpot_slo_violations.labels(model, model),
        )
        self._series[model] = series
        return series

    def error(self, series: ModelSeries | None, code: str) -> None:
        label = series.label if series else ""
        self.errors.labels(label, label, code).inc()
