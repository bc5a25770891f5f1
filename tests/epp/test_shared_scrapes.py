"""The scraper with scrape sharing (``epp.datalayer.scraper``'s :class:`SharedScrapes`): it skips
an endpoint while another replica's view of it is fresh and scrapes it once that is stale, hands
the owner's results over with its period, and counts a peer's requests as busy. Then two scrapers
sharing through :class:`~epp.sync.scrape_share.ScrapeShare` (messages handed over in process):
a stalled engine leaves the non-owner's scheduling within the documented bound, whether the
owner lives (its failure arrives) or not (the non-owner falls back)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from epp.app import EppApp
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.load.peer_totals import PeerTotals
from epp.scheduling.types import Endpoint, EngineMetrics
from epp.sync.messages import Capability
from epp.sync.scrape_owners import owner
from epp.sync.scrape_share import ScrapeShare
from epp.sync.state import ReplicaSyncState, SyncTargets
from tests.epp.factories import FakeClock, local_epp_settings
from tests.epp.fake_engine import Engine
from tests.support import eventually

FAST_S, IDLE_S, TIMEOUT_S = 0.01, 600.0, 0.3


class StubShare:
    """A :class:`SharedScrapes` the test steers: fresh ``until``, a peer's requests ``busy``."""

    def __init__(self) -> None:
        self.until = -math.inf
        self.busy = False
        self.results: list[tuple[str, EngineMetrics | str, float]] = []

    def shared_until(self, endpoint: str, now: float) -> float:
        return self.until

    def scraped(self, endpoint: str, result: EngineMetrics | str, period_s: float) -> None:
        self.results.append((endpoint, result, period_s))

    def peer_busy(self, endpoint: str) -> bool:
        return self.busy

    def forget(self, endpoint: str) -> None:
        pass


@asynccontextmanager
async def sharing(engine: Engine, clock: FakeClock, share: StubShare) -> AsyncIterator[MetricsScraper]:
    store = EndpointStore()
    scraper = MetricsScraper(store, clock, interval=FAST_S, timeout=TIMEOUT_S, idle_interval=IDLE_S)
    scraper.share = share
    scraper.start()
    store.replace([Endpoint("e0", "127.0.0.1", engine.port)])
    try:
        yield scraper
    finally:
        await scraper.close()


async def test_the_owner_scrapes_and_hands_each_result_over_with_its_period(
    engine: Engine, clock: FakeClock
) -> None:
    share = StubShare()
    async with sharing(engine, clock, share) as scraper:
        await eventually(lambda: len(share.results) == 1, what="the first scrape handed over")
        name, figures, period = share.results[0]
        assert name == "e0" and isinstance(figures, EngineMetrics) and period == IDLE_S
        # A peer's requests there make it busy: the fast tick, and said so.
        share.busy = True
        assert scraper.period("e0", clock()) == FAST_S
        engine.metrics_body = b"not metrics"
        clock.advance(1.0)
        scraper.hurry()
        await eventually(lambda: len(share.results) == 2, what="the failed scrape handed over")
        assert isinstance(share.results[1][1], str) and share.results[1][2] == FAST_S


async def test_a_non_owner_skips_while_the_view_is_fresh_and_scrapes_once_it_is_stale(
    engine: Engine, clock: FakeClock
) -> None:
    share = StubShare()
    share.until = clock() + 0.3
    async with sharing(engine, clock, share) as scraper:
        await asyncio.sleep(0.05)  # the poller started, and is waiting out the fresh view
        scraper.hurry()  # flow control wants fresh figures: not from this replica
        await asyncio.sleep(0.05)
        assert engine.metrics_calls == 0
        clock.advance(0.3)  # the owner's next result is overdue when the wait ends on its own
        await eventually(lambda: engine.metrics_calls >= 1, what="the fallback scrape")
        assert scraper.store.is_healthy("e0")


# ---- two scrapers sharing ----------------------------------------------------------------------

BUSY_S, STALE_S = 0.02, 0.06
"""Fast ticks and a staleness bound of 3 of them, as in the EPP (50 ms, 150 ms), scaled down."""


class SharingReplica:
    """A replica's store, scraper and scrape share; :meth:`pump` stands in for NATS."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.sync = ReplicaSyncState(
            name,
            SyncTargets(token_load=PeerTotals()),
            clock=time.monotonic,
            incarnation=1,
            capabilities=Capability.SHARES_SCRAPES,
        )
        self.store = EndpointStore()
        self.scraper = MetricsScraper(self.store, time.monotonic, interval=BUSY_S, timeout=TIMEOUT_S)
        self.share = ScrapeShare(self.sync, self.store, clock=time.monotonic, stale_after_s=STALE_S)
        self.scraper.share = self.share
        self.engine = engine
        self.alive = True

    def start(self) -> None:
        self.scraper.start()
        self.store.replace([Endpoint("e0", "127.0.0.1", self.engine.port)])


async def pump(src: SharingReplica, dst: SharingReplica) -> None:
    """Deliver ``src``'s SCRAPES to ``dst`` every fast tick while ``src`` lives."""
    while src.alive:
        if (data := src.share.take_message()) is not None:
            dst.share.receive(data)
        await asyncio.sleep(BUSY_S)


@pytest.mark.parametrize("owner_lives", [True, False])
async def test_a_stalled_engine_leaves_the_non_owners_scheduling_within_the_bound(
    engine: Engine, owner_lives: bool
) -> None:
    """On the fast tick: out within ``interval + timeout + stale_after_s``, whether the owner's
    failure arrives or, the owner gone, the non-owner's own scrape finds the stall. (With the
    owner alive the non-owner falls back too: the owner's scrape of the stalled engine is pending
    for the timeout, longer than the shared view stays fresh.)"""
    names = ("a", "b")
    first = owner("e0", names)
    own, other = SharingReplica(first, engine), SharingReplica(next(n for n in names if n != first), engine)
    for src, dst in ((own, other), (other, own)):
        dst.sync.receive(src.sync.heartbeat())
    assert own.share.owns("e0") and not other.share.owns("e0")
    own.start()
    other.start()
    pumps = [asyncio.create_task(pump(own, other)), asyncio.create_task(pump(other, own))]
    try:
        await eventually(lambda: other.store.is_healthy("e0"), what="the shared view at the non-owner")
        await asyncio.sleep(0.2)
        calls, fallbacks = engine.metrics_calls, other.share.stats.fallback
        await asyncio.sleep(0.2)
        # The owner alone scrapes it: about 10 in 0.2 s on the 20 ms tick (20 if both did).
        assert engine.metrics_calls - calls <= 13 and other.share.stats.fallback == fallbacks
        if not owner_lives:
            own.alive = False
            await own.scraper.close()
        engine.metrics_delay_s = 2.0  # past any bound here (the engine's teardown waits it out)
        stalled_at = time.monotonic()
        await eventually(lambda: not other.store.is_healthy("e0"), timeout_s=3, what="the stalled engine out")
        assert time.monotonic() - stalled_at < BUSY_S + TIMEOUT_S + STALE_S + 0.1
        assert other.share.stats.applied > 0
    finally:
        own.alive = other.alive = False
        await asyncio.gather(*pumps)
        await own.scraper.close()
        await other.scraper.close()


async def test_the_epp_shares_scrapes_when_synced_unless_told_not_to(tmp_path: Path) -> None:
    nats = ["nats://127.0.0.1:1"]
    app = EppApp(local_epp_settings(tmp_path, sync_nats_url=nats))
    assert app.sync is not None and app.sync.scrape_share is app.scraper.share is not None
    assert app.sync.state.capabilities == Capability.SHARES_SCRAPES
    assert app.sync.state.on_peer_requests == app.scraper.on_peer_requests
    assert app.sync.scrape_batch_s == app.scraper.interval
    off = EppApp(local_epp_settings(tmp_path, sync_nats_url=nats, sync_share_scrapes=False))
    assert off.sync is not None and off.sync.scrape_share is off.scraper.share is None
    assert off.sync.state.capabilities == Capability.NONE
