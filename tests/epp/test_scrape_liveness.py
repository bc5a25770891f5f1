"""When a late scrape takes an endpoint out of scheduling: only once the engine has shown no
sign of life (a good scrape, or an answer to a request) for the scrape timeout. A refused or
failed scrape takes it out at once."""

from __future__ import annotations

import asyncio
import json
import time

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.scheduling.types import Endpoint, EngineMetrics
from tests.epp.extproc_harness import (
    Harness,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    routed_destination,
)
from tests.epp.fake_engine import Engine
from tests.support import eventually

TIMEOUT_S = 0.3
STREAMED = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "stream": True}


async def started(engine: Engine, timeout_s: float = TIMEOUT_S) -> tuple[EndpointStore, MetricsScraper]:
    store = EndpointStore()
    scraper = MetricsScraper(store, time.monotonic, interval=0.02, timeout=timeout_s)
    scraper.start()
    store.replace([Endpoint("e0", "127.0.0.1", engine.port)])
    await eventually(lambda: store.is_healthy("e0"), what="a first good scrape")
    return store, scraper


async def health_while(store: EndpointStore, seconds: float, answering: bool) -> list[bool]:
    """Sample the endpoint's health every 10 ms for ``seconds``, telling the store that the
    engine answered a request every 50 ms if ``answering``."""
    loop = asyncio.get_running_loop()
    end, next_answer, seen = loop.time() + seconds, 0.0, []
    while loop.time() < end:
        if answering and loop.time() >= next_answer:
            store.record_alive("e0", time.monotonic())
            next_answer = loop.time() + 0.05
        seen.append(store.is_healthy("e0"))
        await asyncio.sleep(0.01)
    return seen


async def test_an_engine_that_answers_requests_stays_in_however_late_its_metrics(engine: Engine) -> None:
    store, scraper = await started(engine)
    try:
        engine.metrics_delay_s = 10 * TIMEOUT_S
        assert all(await health_while(store, 5 * TIMEOUT_S, answering=True))
        # It stops answering too: out, but not before a whole timeout without a sign of life.
        quiet_from = time.monotonic()
        await eventually(lambda: not store.is_healthy("e0"), timeout_s=3, what="the stalled engine out")
        assert time.monotonic() - quiet_from >= TIMEOUT_S - 0.06  # its last answer came ≤ 50 ms before
        assert store.candidates() == []
        engine.metrics_delay_s = 0.0
        await eventually(lambda: store.is_healthy("e0"), what="back with its next good scrape")
    finally:
        await scraper.close()


async def test_an_engine_that_stalls_is_out_within_about_the_timeout(engine: Engine) -> None:
    store, scraper = await started(engine)
    try:
        engine.metrics_delay_s = 30.0
        stalled_at = time.monotonic()
        await eventually(lambda: not store.is_healthy("e0"), timeout_s=3, what="the stalled engine out")
        assert time.monotonic() - stalled_at < TIMEOUT_S + 0.3
    finally:
        await scraper.close()


async def test_a_failed_scrape_takes_the_endpoint_out_at_once(engine: Engine) -> None:
    """A 5 s timeout, yet an engine answering something that is not metrics is out at once."""
    store, scraper = await started(engine, timeout_s=5.0)
    try:
        engine.metrics_body = b"<html>not metrics</html>"
        failed_at = time.monotonic()
        await eventually(lambda: not store.is_healthy("e0"), timeout_s=3, what="the broken engine out")
        assert time.monotonic() - failed_at < 1.0
    finally:
        await scraper.close()


def test_an_answer_is_a_sign_of_life_but_does_not_restore_an_unhealthy_endpoint() -> None:
    store = EndpointStore()
    store.replace([Endpoint("e0", "10.0.0.1", 8000)])
    assert store.alive_at("e0") == float("-inf") and store.alive_at("gone") == float("-inf")
    store.record_scrape("e0", EngineMetrics(updated_at=5.0))
    assert store.alive_at("e0") == 5.0
    store.record_alive("e0", 7.0)
    store.record_alive("e0", 6.0)  # a late report does not move it back
    assert store.alive_at("e0") == 7.0
    store.record_failure("e0", "HTTP 503")
    store.record_alive("e0", 8.0)
    assert not store.is_healthy("e0") and store.alive_at("e0") == 8.0


async def test_the_director_counts_response_headers_and_tokens_as_signs_of_life() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    replies = await s.on_message(body_msg(json.dumps(STREAMED).encode(), eos=True))
    name = "e0" if routed_destination(replies[0]).endswith("8000") else "e1"
    before = h.store.alive_at(name)
    h.clock.advance(1.0)
    await s.on_message(response_headers_msg(200, "text/event-stream"))
    assert h.store.alive_at(name) == before + 1.0
    h.clock.advance(1.0)
    await s.on_message(response_body_msg(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n', eos=False))
    assert h.store.alive_at(name) == before + 2.0
    s.close()
