from __future__ import annotations

import random

import pytest

import epp.plugins  # noqa: F401  (registers plugin types)
from epp.scheduling.framework import PluginContext
from tests.epp.factories import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def context(clock: FakeClock) -> PluginContext:
    return PluginContext(clock=clock, rng=random.Random(7))
