"""Integration fixtures: a real Envoy, the EPP and simulated replicas, on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.stack import LocalStack, StackConfig, StackPorts

pytestmark = pytest.mark.integration


def start_stack(workdir: Path, replicas: int, **overrides) -> LocalStack:
    config = StackConfig(replicas=replicas, ports=StackPorts.free(), workdir=workdir, **overrides)
    stack = LocalStack(config)
    stack.start()
    return stack


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


def scrape(url: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (labels as printed)."""
    values = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric_sum(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for key, value in scrape(url).items():
        metric, _, label_text = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += value
    return total
