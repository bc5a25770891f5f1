from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

import epp.plugins  # noqa: F401  (registers plugin types)
from epp.scheduling.framework import PluginContext
from tests.epp.factories import FakeClock
from tests.epp.fake_engine import Engine


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def context(clock: FakeClock) -> PluginContext:
    return PluginContext(clock=clock, rng=random.Random(7))


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    """A fake engine on a free loopback port."""
    fake = Engine()
    app = web.Application()
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_get("/v1/models", fake.models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = site._server.sockets[0].getsockname()[1]
    yield fake
    await runner.cleanup()
