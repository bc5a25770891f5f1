"""Scrape sharing through a real nats-server: three replicas (each its store, scraper, sync state,
scrape share and NATS transport, as ``epp.app`` wires them) over six fake engines. Each engine is
scraped by exactly one replica, its rendezvous owner, and every replica holds fresh figures of
all six; a replica that stops has its engines scraped again by the others within the staleness
bound, then owned by one of them; a stalled engine leaves a non-owner's scheduling within the
scraper's bound plus the staleness bound."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.keepalive_http import KeepAliveHttp
from epp.load.peer_totals import PeerTotals
from epp.scheduling.types import Endpoint
from epp.sync.messages import Capability
from epp.sync.nats_transport import NatsSyncTransport
from epp.sync.scrape_owners import owner
from epp.sync.scrape_share import STALE_AFTER_TICKS, ScrapeShare
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from tests.epp.fake_engine import Engine, serve
from tests.epp.sync_replicas import Nats
from tests.support import eventually

pytestmark = pytest.mark.integration
TUNING = SyncTuning(progress_interval_s=0.02, heartbeat_interval_s=0.1, peer_timeout_s=0.8)
TICK_S, TIMEOUT_S = 0.05, 0.3
STALE_S = STALE_AFTER_TICKS * TICK_S
NAMES = ("epp-0", "epp-1", "epp-2")


class CountingScraper(MetricsScraper):
    """The EPP's scraper, counting its scrapes per endpoint."""

    def __init__(self, store: EndpointStore) -> None:
        # Every engine on the fast tick (idle or not): the most a replica could scrape.
        super().__init__(store, time.monotonic, interval=TICK_S, timeout=TIMEOUT_S, idle_interval=TICK_S)
        self.scrapes: Counter[str] = Counter()

    async def scrape_once(self, name: str, client: KeepAliveHttp) -> None:
        self.scrapes[name] += 1
        await super().scrape_once(name, client)


class Replica:
    def __init__(self, name: str, url: str, endpoints: list[Endpoint]) -> None:
        self.name = name
        self.sync = ReplicaSyncState(
            name,
            SyncTargets(token_load=PeerTotals()),
            clock=time.monotonic,
            wall_clock=time.time,
            tuning=TUNING,
            capabilities=Capability.SHARES_SCRAPES,
        )
        self.store = EndpointStore()
        self.scraper = CountingScraper(self.store)
        self.share = ScrapeShare(self.sync, self.store, clock=time.monotonic, stale_after_s=STALE_S)
        self.scraper.share = self.share
        self.sync.on_peer_requests = self.scraper.on_peer_requests
        self.transport = NatsSyncTransport(
            self.sync, [url], "llm-epp-test.pool", scrape_share=self.share, scrape_batch_s=TICK_S
        )
        self.endpoints = endpoints

    async def start(self) -> None:
        self.scraper.start()
        self.store.replace(self.endpoints)
        await self.transport.start()

    async def stop(self) -> None:
        await self.transport.close()
        await self.scraper.close()


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, Engine]]:
    fakes = {f"e{i}": Engine() for i in range(6)}
    runners = [await serve(engine) for engine in fakes.values()]
    yield fakes
    for engine in fakes.values():
        engine.metrics_delay_s = 0.0
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def replicas(nats_server: Nats, engines: dict[str, Engine]) -> AsyncIterator[dict[str, Replica]]:
    endpoints = [Endpoint(name, "127.0.0.1", engine.port) for name, engine in engines.items()]
    started = {name: Replica(name, nats_server.url, endpoints) for name in NAMES}
    for replica in started.values():
        await replica.start()
    yield started
    for replica in started.values():
        await replica.stop()


def sharing(replicas: dict[str, Replica]) -> bool:
    """Every replica knows every other as a replica that shares scrapes."""
    return all(
        r.sync.peers_with(Capability.SHARES_SCRAPES) == frozenset(replicas) - {name}
        for name, r in replicas.items()
    )


async def scrapes_over(
    replicas: dict[str, Replica], engines: dict[str, Engine], seconds: float
) -> dict[str, Counter]:
    """Each replica's scrapes per endpoint over ``seconds``; checks they are all the engines saw."""
    before = {name: Counter(r.scraper.scrapes) for name, r in replicas.items()}
    hits = {name: e.metrics_calls for name, e in engines.items()}
    await asyncio.sleep(seconds)
    counted = {name: r.scraper.scrapes - before[name] for name, r in replicas.items()}
    # A scrape in flight at either end may be counted here and not yet at the engine, or so.
    for endpoint, engine in engines.items():
        assert abs(engine.metrics_calls - hits[endpoint] - sum(c[endpoint] for c in counted.values())) <= len(
            replicas
        )
    return counted


def scraped_by(counted: dict[str, Counter], endpoint: str) -> list[str]:
    return sorted(name for name, counts in counted.items() if counts[endpoint] > 0)


async def test_each_engine_is_scraped_by_its_owner_alone_and_every_replica_sees_all(
    replicas: dict[str, Replica], engines: dict[str, Engine]
) -> None:
    await eventually(lambda: sharing(replicas), what="every replica announcing scrape sharing to the others")
    await asyncio.sleep(2 * STALE_S)  # the scrapes of the start, before the peers knew each other, are over
    fallbacks = [r.share.stats.fallback for r in replicas.values()]
    counted = await scrapes_over(replicas, engines, 1.0)
    for endpoint in engines:
        assert scraped_by(counted, endpoint) == [owner(endpoint, NAMES)], counted
        # On the 50 ms tick: about 20 in the second (fewer on a busy machine), not 3 × that.
        assert 8 <= sum(c[endpoint] for c in counted.values()) <= 22, counted
    assert [r.share.stats.fallback for r in replicas.values()] == fallbacks
    now = time.monotonic()
    for r in replicas.values():
        for state in r.store.all():
            assert r.store.is_healthy(state.name) and state.metrics.age(now) < TICK_S + STALE_S, (
                r.name,
                state,
            )
        # Until it heard the others every replica owned every engine and published its scrapes,
        # which may have come after a newer one of the receiver's own: dropped as older.
        assert r.share.stats.applied > 0 and set(r.share.stats.dropped) <= {"older"}


async def test_a_stopped_replicas_engines_are_scraped_by_the_others_then_owned_by_one(
    replicas: dict[str, Replica], engines: dict[str, Engine]
) -> None:
    await eventually(lambda: sharing(replicas), what="every replica announcing scrape sharing to the others")
    await asyncio.sleep(2 * STALE_S)
    leaver = replicas.pop("epp-1")
    orphans = [e for e in engines if owner(e, NAMES) == "epp-1"]
    assert orphans  # 6 engines over 3 replicas: in this draw, some are its
    hits = {e: engines[e].metrics_calls for e in orphans}
    await leaver.stop()
    stopped = time.monotonic()
    # Scraped again once the shared view is stale: within the owner's period and the bound.
    await eventually(
        lambda: all(engines[e].metrics_calls > hits[e] for e in orphans),
        timeout_s=2,
        what="the orphans scraped",
    )
    assert time.monotonic() - stopped < TICK_S + STALE_S + 0.15
    # Once the survivors expire it (peer timeout 0.8 s), each engine has one owner among them again.
    await eventually(
        lambda: all(r.sync.peers == [n for n in replicas if n != name] for name, r in replicas.items())
    )
    await asyncio.sleep(2 * STALE_S)
    counted = await scrapes_over(replicas, {e: engines[e] for e in engines}, 0.5)
    survivors = tuple(replicas)
    for endpoint in engines:
        assert scraped_by(counted, endpoint) == [owner(endpoint, survivors)], counted
    assert all(r.share.stats.fallback > 0 for r in replicas.values())


async def test_a_stalled_engine_leaves_a_non_owners_scheduling_within_the_bound(
    replicas: dict[str, Replica], engines: dict[str, Engine]
) -> None:
    await eventually(lambda: sharing(replicas), what="every replica announcing scrape sharing to the others")
    await asyncio.sleep(2 * STALE_S)
    endpoint = "e0"
    others = [r for name, r in replicas.items() if name != owner(endpoint, NAMES)]
    engines[endpoint].metrics_delay_s = 3.0
    stalled_at = time.monotonic()
    await eventually(
        lambda: not any(r.store.is_healthy(endpoint) for r in others),
        timeout_s=3,
        what="the stalled engine out",
    )
    # The scraper's busy bound (tick + timeout) plus the staleness bound, with 0.1 s of slack.
    assert time.monotonic() - stalled_at < TICK_S + TIMEOUT_S + STALE_S + 0.1
    assert all(r.store.is_healthy(e) for r in replicas.values() for e in engines if e != endpoint)
