"""Integration fixtures: a real Envoy, the EPP and simulated replicas, on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Three replicas with the fast engine profile and a 256 KiB request-body limit."""
    s = start_stack(
        tmp_path_factory.mktemp("stack"),
        replicas=3,
        sim_profile="instant",
        epp_args=["--max-body-bytes", str(256 << 10)],
    )
    yield s
    s.stop()


@pytest.fixture
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=30)
