from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import epp.plugin_types  # noqa: F401  (registers every plugin type)
from epp.scheduling.framework import PluginContext
from tests.epp.factories import FakeClock
from tests.epp.fake_engine import Engine, serve
from tests.epp.sync_replicas import Nats


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
    runner = await serve(fake)
    yield fake
    await runner.cleanup()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    """A real nats-server on a free port."""
    server = Nats(tmp_path)
    server.start()
    yield server
    server.stop()
