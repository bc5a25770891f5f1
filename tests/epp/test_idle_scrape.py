"""The scraper's two ticks: fast while an endpoint is busy, slow while it is idle, and a request
routed to an idle endpoint gets it scraped at once (never faster than the fast tick)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvloop

from epp.app import EppApp
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper, _Poller
from epp.keepalive_http import KeepAliveHttp
from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.types import Endpoint, EngineMetrics, SchedulingResult
from tests.epp.factories import FakeClock, local_epp_settings, make_request
from tests.epp.fake_engine import Engine
from tests.support import eventually

FAST_S, IDLE_S, LINGER_S, TIMEOUT_S = 0.01, 600.0, 2.0, 0.3
"""An idle tick far longer than any test: a scrape that comes sooner was not the idle tick's."""


@asynccontextmanager
async def polling(
    engine: Engine, clock: FakeClock, interval: float = FAST_S
) -> AsyncIterator[tuple[EndpointStore, MetricsScraper]]:
    """One idle endpoint, healthy after its first scrape; the scraper stamps with ``clock``."""
    store = EndpointStore()
    scraper = MetricsScraper(
        store, clock, interval=interval, timeout=TIMEOUT_S, idle_interval=IDLE_S, linger_s=LINGER_S
    )
    scraper.start()
    store.replace([Endpoint("e0", "127.0.0.1", engine.port)])
    try:
        await eventually(lambda: store.is_healthy("e0"), what="a first good scrape")
        yield store, scraper
    finally:
        await scraper.close()


@pytest.fixture
async def scraped(engine: Engine, clock: FakeClock) -> AsyncIterator[tuple[EndpointStore, MetricsScraper]]:
    async with polling(engine, clock) as polled:
        yield polled


def routed_to(store: EndpointStore) -> RoutedRequest:
    state = store.by_name("e0")
    assert state is not None
    return RoutedRequest(
        make_request([1, 2]), SchedulingResult((state.endpoint,), "p"), CycleState(), state, 0.0
    )


def finished(routed: RoutedRequest, at: float) -> RequestOutcome:
    return RequestOutcome(routed.result.endpoint, 0.0, at, 200, False, True, None, None)


async def test_an_idle_endpoint_is_polled_on_the_idle_tick(scraped, clock: FakeClock) -> None:
    _, scraper = scraped
    assert scraper.period("e0", clock()) == IDLE_S


async def test_requests_in_flight_or_running_in_the_engine_make_it_busy(scraped, clock: FakeClock) -> None:
    store, scraper = scraped
    state = store.by_name("e0")
    assert state is not None
    state.in_flight = 1
    assert scraper.period("e0", clock()) == FAST_S
    state.in_flight = 0
    for busy in (EngineMetrics(running=1), EngineMetrics(waiting=2)):
        store.record_scrape("e0", busy)  # a peer replica's requests, say
        assert scraper.period("e0", clock()) == FAST_S
    store.record_scrape("e0", EngineMetrics(kv_cache_usage=0.3))
    assert scraper.period("e0", clock()) == IDLE_S


async def test_it_stays_busy_for_the_linger_after_a_request_is_routed_or_finishes(
    scraped, clock: FakeClock
) -> None:
    store, scraper = scraped
    routed = routed_to(store)
    scraper.on_routed(routed, clock())
    clock.advance(LINGER_S - 0.1)
    assert scraper.period("e0", clock()) == FAST_S
    clock.advance(0.2)
    assert scraper.period("e0", clock()) == IDLE_S
    scraper.on_finished(routed, finished(routed, clock()))
    clock.advance(LINGER_S - 0.1)
    assert scraper.period("e0", clock()) == FAST_S
    clock.advance(0.2)
    assert scraper.period("e0", clock()) == IDLE_S


async def test_an_endpoint_out_of_scheduling_is_polled_on_the_fast_tick(scraped, clock: FakeClock) -> None:
    """So that it is back at its first good scrape."""
    store, scraper = scraped
    store.record_failure("e0", "502 from upstream")
    assert scraper.period("e0", clock()) == FAST_S


async def test_a_request_routed_to_an_idle_endpoint_gets_it_scraped_at_once(
    scraped, engine: Engine, clock: FakeClock
) -> None:
    store, scraper = scraped
    await eventually(lambda: engine.metrics_calls >= 1)
    before = engine.metrics_calls
    clock.advance(1.0)
    scraper.on_routed(routed_to(store), clock())
    # Then on the fast tick while it lingers: more scrapes than the idle tick would ever give.
    await eventually(lambda: engine.metrics_calls >= before + 3, what="scrapes on the fast tick")


async def test_hurrying_never_scrapes_faster_than_the_fast_tick(engine: Engine, clock: FakeClock) -> None:
    """A fast tick of 300 s (on ``clock``): hurried within it, the next scrape waits for its end."""
    async with polling(engine, clock, interval=300.0) as (_, scraper):
        await eventually(lambda: engine.metrics_calls >= 1)
        before = engine.metrics_calls
        scraper.hurry()
        await asyncio.sleep(0.05)  # a scrape hurried at once would come within a millisecond or two
        assert engine.metrics_calls == before
        clock.advance(300.0)
        scraper.hurry()
        await eventually(lambda: engine.metrics_calls == before + 1, what="the hurried scrape")


async def test_a_stalled_idle_endpoint_leaves_scheduling_once_a_request_is_routed_there(
    scraped, engine: Engine, clock: FakeClock
) -> None:
    """Within about a timeout of the scrape the request triggers (its silence counts from one
    fast tick before that scrape, not from its last idle scrape)."""
    store, scraper = scraped
    engine.metrics_delay_s = 1.0
    clock.advance(2 * TIMEOUT_S)
    scraper.on_routed(routed_to(store), clock())
    await eventually(lambda: not store.is_healthy("e0"), timeout_s=3, what="the stalled endpoint out")
    assert store.candidates() == []


def test_a_wait_of_no_time_can_be_hurried_on_uvloop() -> None:
    """The EPP runs on uvloop, whose zero-delay timers are plain handles (no ``when()``)."""

    async def hurried() -> None:
        poller = _Poller(KeepAliveHttp("127.0.0.1", 1))
        waiting = asyncio.create_task(poller.sleep(0.0))
        await asyncio.sleep(0)  # the wait begins
        poller.hurry(0.0)
        await waiting

    uvloop.run(hurried())


async def test_the_scrape_a_request_triggers_gets_a_whole_timeout_however_long_ago_the_last_was(
    scraped, engine: Engine, clock: FakeClock
) -> None:
    """An idle engine was not asked for 10 s: that silence is no stall, and it answers this scrape
    a third of a timeout late, as a busy engine does; it stays in, on that one scrape."""
    store, scraper = scraped
    await eventually(lambda: engine.metrics_calls >= 1)
    before = engine.metrics_calls
    engine.metrics_delay_s = TIMEOUT_S / 3
    clock.advance(10.0)
    scraper.on_routed(routed_to(store), clock())
    state = store.by_name("e0")
    assert state is not None
    await eventually(lambda: state.metrics.updated_at == clock(), what="the scrape the request triggered")
    assert store.is_healthy("e0") and engine.metrics_calls == before + 1


async def test_the_epp_wires_the_idle_tick_into_its_lifecycle_and_flow_control(tmp_path: Path) -> None:
    config = tmp_path / "flow-control.yaml"
    config.write_text(
        "plugins:\n- type: queue-scorer\n- type: queue-kv-saturation-detector\nfeatureGates: [flowControl]\n"
    )
    app = EppApp(local_epp_settings(tmp_path, config=str(config), idle_scrape_interval_s=0.7))
    assert app.scraper.idle_interval == 0.7 and app.scraper.interval == 0.05
    assert app.scraper in app.lifecycle.observers
    assert app.flow_gate is not None and app.flow_gate.on_queued == app.scraper.hurry
