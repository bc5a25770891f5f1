"""The context length of each engine: read from /v1/models by the scraper, kept by the store."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.served_models import ModelsParseError, parse_max_model_len
from epp.scheduling.types import Endpoint
from sim.openai_api import models_response
from tests.epp.fake_engine import METRICS, Engine
from tests.support import eventually


def test_an_engines_context_is_the_longest_listed() -> None:
    listing = models_response("tiny", "/models/tiny", 2048, created=1)
    adapter = {**listing["data"][0], "id": "tiny-lora", "parent": "tiny", "max_model_len": 4096}
    body = json.dumps({**listing, "data": [*listing["data"], adapter, {"id": "odd"}]}).encode()
    assert parse_max_model_len(body) == 4096


@pytest.mark.parametrize(
    "body",
    [
        b"<html>",
        b"[]",
        b'{"data": 5}',
        b'{"data": [{"max_model_len": "2048"}]}',
        b'{"data": [{"max_model_len": 0}]}',
    ],
)
def test_listings_without_a_context_length_are_errors(body: bytes) -> None:
    with pytest.raises(ModelsParseError):
        parse_max_model_len(body)


def test_the_pools_context_is_the_longest_any_endpoint_reported() -> None:
    store = EndpointStore()
    store.replace([Endpoint("a", "10.0.0.1", 8000), Endpoint("b", "10.0.0.2", 8000)])
    assert store.max_model_len() is None
    store.record_max_model_len("a", 2048)
    store.record_max_model_len("b", 8192)
    store.record_max_model_len("gone", 100_000)
    assert store.max_model_len() == 8192
    store.replace([Endpoint("a", "10.0.0.1", 8000)])
    assert store.max_model_len() == 2048


async def test_the_scraper_learns_each_engines_context_and_follows_changes(engine: Engine) -> None:
    store = EndpointStore()
    scraper = MetricsScraper(store, time.monotonic, interval=0.01, models_refresh_s=0.2, models_retry_s=0.05)
    scraper.start()
    store.replace([Endpoint("e0", "127.0.0.1", engine.port)])
    try:
        await eventually(lambda: store.is_healthy("e0") and len(engine.models_calls) >= 2)
        assert store.max_model_len() is None  # 404s: nothing learned, retried
        assert store.model_roots() == {}
        engine.max_model_len = 2048
        await eventually(lambda: store.max_model_len() == 2048)
        assert store.model_roots() == {"e0": "/m"}  # what the auto tokenizer source loads
        engine.max_model_len = 4096  # restarted in place with a longer context
        await eventually(lambda: store.max_model_len() == 4096)
        calls = len(engine.models_calls)
        await asyncio.sleep(0.1)
        assert len(engine.models_calls) <= calls + 1  # refreshed, not read on every scrape
    finally:
        await scraper.close()


async def test_an_unchanged_scrape_is_fresh_and_a_changed_one_is_read(engine: Engine) -> None:
    """The scraper skips parsing a body equal to the last one, but not stamping it."""
    store = EndpointStore()
    scraper = MetricsScraper(store, time.monotonic, interval=0.01)
    scraper.start()
    store.replace([Endpoint("e0", "127.0.0.1", engine.port)])

    def metrics():
        state = store.by_name("e0")
        assert state is not None
        return state.metrics

    try:
        await eventually(lambda: store.is_healthy("e0"))
        first = metrics().updated_at
        await eventually(lambda: metrics().updated_at > first + 0.03)  # same body, fresh figures
        assert (metrics().waiting, metrics().kv_cache_usage) == (0, 0.1)
        engine.metrics_body = METRICS.replace(b"waiting 0", b"waiting 7").replace(b"perc 0.1", b"perc 0.5")
        await eventually(lambda: (metrics().waiting, metrics().kv_cache_usage) == (7, 0.5))
        engine.metrics_body = b"not metrics"
        await eventually(lambda: not store.is_healthy("e0"))
        engine.metrics_body = METRICS  # back to a body parsed before: read again, not stale
        await eventually(lambda: store.is_healthy("e0") and metrics().waiting == 0)
    finally:
        await scraper.close()
