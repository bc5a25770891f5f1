"""Prometheus metrics of replica sync.

Counts are read from the state's :class:`~epp.sync.state.SyncStats` at scrape time (no
bookkeeping on the hot path); the transport sets ``llm_epp_sync_connected`` and observes the
publish→apply lag.

================================================  ======================================================
metric                                            meaning
================================================  ======================================================
llm_epp_sync_connected                            1 while connected to NATS
llm_epp_sync_lag_seconds                          publish (peer's wall clock) → apply here, per message
llm_epp_sync_deltas_sent_total{kind}              deltas this replica published
llm_epp_sync_deltas_applied_total{kind}           peers' deltas applied here
llm_epp_sync_deltas_dropped_total{reason}         deltas (or whole unreadable messages) not applied
llm_epp_sync_gaps_total                           times a peer's messages were found missing
llm_epp_sync_snapshots_total{outcome}             snapshots requested, installed, failed, stale, served
llm_epp_sync_peers_alive                          peers heard from within the timeout
llm_epp_sync_peers_expired_total                  peers dropped after going silent
llm_epp_endpoint_remote_token_share{name, pod}    peers' share of the endpoint's tokens in flight
llm_epp_sync_scrapes_published_total              endpoint scrapes published (of those this replica owns)
llm_epp_sync_scrapes_applied_total                peers' endpoint scrapes applied here instead of scraping
llm_epp_sync_scrapes_fallback_total               scrapes of endpoints a peer owns (its view was stale)
llm_epp_sync_scrapes_dropped_total{reason}        peers' endpoint scrapes not applied (or ours not sent)
llm_epp_sync_scrapes_owned                        endpoints this replica owns (scrapes and publishes)
================================================  ======================================================

The ``scrapes`` series are there with scrape sharing on (``epp.sync.scrape_share``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datalayer.endpoints import EndpointStore
from epp.plugins.token_load import BooksTokenLoad
from epp.sync.scrape_share import ScrapeShare
from epp.sync.state import ReplicaSyncState

REMOTE_TOKEN_SHARE = "llm_epp_endpoint_remote_token_share"
"""Per endpoint: the share of its tokens in flight that peer replicas booked."""
LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class _SyncCollector(Collector):
    def __init__(
        self,
        pool: str,
        store: EndpointStore,
        state: ReplicaSyncState,
        token_load: BooksTokenLoad | None,
        share: ScrapeShare | None,
    ) -> None:
        self.pool, self.store, self.state, self.token_load = pool, store, state, token_load
        self.share = share

    def collect(self) -> Iterator[Metric]:
        stats = self.state.stats
        for name, help_text, label, counts in (
            ("llm_epp_sync_deltas_sent", "Deltas of this replica's bookings published", "kind", stats.sent),
            ("llm_epp_sync_deltas_applied", "Peers' deltas applied here", "kind", stats.applied),
            (
                "llm_epp_sync_deltas_dropped",
                "Deltas not applied (a message refused whole, for its schema version or form, counts once)",
                "reason",
                stats.dropped,
            ),
            ("llm_epp_sync_snapshots", "Snapshots, by outcome", "outcome", stats.snapshots),
        ):
            family = CounterMetricFamily(name, help_text, labels=[label])
            for value, count in sorted(counts.items()):
                family.add_metric([value], count)
            yield family
        yield CounterMetricFamily("llm_epp_sync_gaps", "Times messages from a peer went missing", stats.gaps)
        yield CounterMetricFamily(
            "llm_epp_sync_peers_expired",
            "Peers dropped, with their bookings, after going silent",
            stats.expired_peers,
        )
        yield GaugeMetricFamily(
            "llm_epp_sync_peers_alive", "Peers heard from within the timeout", len(self.state.peers)
        )
        if self.token_load is not None:
            yield self._remote_share(self.token_load)
        if self.share is not None:
            yield from self._scrapes(self.share)

    def _scrapes(self, share: ScrapeShare) -> Iterator[Metric]:
        stats = share.stats
        for name, help_text, count in (
            (
                "published",
                "Endpoint scrapes this replica published to its peers (it owns them)",
                stats.published,
            ),
            ("applied", "Peers' endpoint scrapes applied here instead of scraping", stats.applied),
            ("fallback", "Scrapes of endpoints a peer owns whose shared view was stale", stats.fallback),
        ):
            yield CounterMetricFamily(f"llm_epp_sync_scrapes_{name}", help_text, count)
        dropped = CounterMetricFamily(
            "llm_epp_sync_scrapes_dropped",
            "Peers' endpoint scrapes not applied, or this replica's not sent",
            labels=["reason"],
        )
        for reason, count in sorted(stats.dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily(
            "llm_epp_sync_scrapes_owned",
            "Endpoints this replica owns: it scrapes them and publishes what it reads",
            sum(share.owns(s.name) for s in self.store.all()),
        )

    def _remote_share(self, producer: BooksTokenLoad) -> GaugeMetricFamily:
        share = GaugeMetricFamily(
            REMOTE_TOKEN_SHARE,
            "Share of the endpoint's tokens in flight that peer replicas booked (0 when none are)",
            labels=["name", "model_server_pod"],
        )
        for s in self.store.all():
            remote = producer.peers.load(s.name).tokens_in_flight
            total = remote + producer.tracker.load(s.name).tokens_in_flight
            share.add_metric([self.pool, s.name], remote / total if total else 0.0)
        return share


class SyncMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        pool: str,
        store: EndpointStore,
        state: ReplicaSyncState,
        token_load: BooksTokenLoad | None,
        share: ScrapeShare | None = None,
    ) -> None:
        self.connected = Gauge(
            "llm_epp_sync_connected", "1 while connected to the sync NATS", registry=registry
        )
        self.lag = Histogram(
            "llm_epp_sync_lag_seconds",
            "Publish (the peer's wall clock) to apply (this replica's), per delta message",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        registry.register(_SyncCollector(pool, store, state, token_load, share))
