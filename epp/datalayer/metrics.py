"""The data layer's Prometheus metrics: the pool's endpoints as the EPP sees them, and its KV events.

Per-endpoint gauges are read from the store (and the token-load tracker, the precise prefix
index) at scrape time, so the hot path keeps no extra bookkeeping for them. Names follow the
Gateway API Inference Extension (``inference_pool_*``) where it has one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.datalayer.endpoints import EndpointStore
from epp.kvcache.precise_index import PreciseIndex
from epp.load.endpoint_speed import EndpointSpeeds
from epp.load.peer_totals import PeerTotals
from epp.load.token_load import TokenLoadTracker

PREFILL_TOKENS_IN_FLIGHT = "llm_epp_endpoint_prefill_tokens_in_flight"
DECODE_TOKENS_IN_FLIGHT = "llm_epp_endpoint_decode_tokens_in_flight"
KV_TOKENS_IN_FLIGHT = "llm_epp_endpoint_kv_tokens_in_flight"
EXPECTED_OUTPUT_TOKENS_IN_FLIGHT = "llm_epp_endpoint_expected_output_tokens_in_flight"
ENDPOINT_SLOWNESS = "llm_epp_endpoint_slowness"
TOKEN_LOAD_GAUGES = (
    PREFILL_TOKENS_IN_FLIGHT,
    DECODE_TOKENS_IN_FLIGHT,
    KV_TOKENS_IN_FLIGHT,
    EXPECTED_OUTPUT_TOKENS_IN_FLIGHT,
)
"""The per-endpoint token-load gauges, exported when token-load scoring is on."""


class _PoolCollector(Collector):
    """Per-endpoint gauges read from the store at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, pool: str, store: EndpointStore, clock: Callable[[], float]) -> None:
        self.pool, self.store, self.clock = pool, store, clock
        self.token_load: TokenLoadTracker | None = None
        self.peers_token_load: PeerTotals | None = None
        self.speeds: EndpointSpeeds | None = None

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
        if self.speeds is not None:
            slowness = GaugeMetricFamily(
                ENDPOINT_SLOWNESS,
                "The endpoint's decode step time over the pool's typical one under the same load, "
                "measured from its requests (1 until measured); token-load scoring multiplies its cost by it",
                labels=labels,
            )
            for s in states:
                slowness.add_metric([self.pool, s.name], self.speeds.slowness(s.name))
            yield slowness

    def _token_load(self, tracker: TokenLoadTracker, names: list[str]) -> Iterator[GaugeMetricFamily]:
        # "Routed by this EPP" includes, with replica sync, what its peers routed (as scoring sees it).
        labels = ["name", "model_server_pod"]
        prefill = GaugeMetricFamily(
            PREFILL_TOKENS_IN_FLIGHT,
            "Uncached prompt tokens routed by this EPP (and its synced peers) and not yet prefilled",
            labels=labels,
        )
        decode = GaugeMetricFamily(
            DECODE_TOKENS_IN_FLIGHT,
            "KV tokens (prompt + generated) of requests routed by this EPP (and its synced peers) "
            "that are decoding",
            labels=labels,
        )
        kv = GaugeMetricFamily(
            KV_TOKENS_IN_FLIGHT,
            "KV tokens (prompt + generated) of every request routed by this EPP (and its synced peers) "
            "and not finished",
            labels=labels,
        )
        remaining = GaugeMetricFamily(
            EXPECTED_OUTPUT_TOKENS_IN_FLIGHT,
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


class PoolMetrics:
    """The pool's per-endpoint gauges, and what else the data layer knows per endpoint."""

    def __init__(
        self, registry: CollectorRegistry, pool: str, store: EndpointStore, clock: Callable[[], float]
    ) -> None:
        self.registry, self.pool, self.store = registry, pool, store
        self._pool = _PoolCollector(pool, store, clock)
        registry.register(self._pool)

    def export_token_load(self, tracker: TokenLoadTracker, peers: PeerTotals | None = None) -> None:
        """Export ``tracker``'s per-endpoint load (the pipeline's ``token-load-producer``), plus
        ``peers``' (the load synced from peer replicas) when given."""
        self._pool.token_load = tracker
        self._pool.peers_token_load = peers

    def export_endpoint_speeds(self, speeds: EndpointSpeeds) -> None:
        """Export each endpoint's measured slowness (the pipeline's ``endpoint-speed-producer``)."""
        self._pool.speeds = speeds

    def track_kv_index(self, index: PreciseIndex) -> None:
        """Export ``index`` per endpoint (blocks, staleness) and its memory."""
        self.registry.register(_KVIndexCollector(self.pool, self.store, index))


class KVEventMetrics:
    """What the KV-event subscriber counts, per endpoint."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
