"""Helpers shared by the tiers that start real processes: stacks on free ports, metric reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from sim.stack import LocalStack, StackConfig, StackPorts


def start_stack(workdir: Path, replicas: int, **overrides) -> LocalStack:
    """Start a gateway stack on free ports; the caller stops it."""
    stack = LocalStack(StackConfig(replicas=replicas, ports=StackPorts.free(), workdir=workdir, **overrides))
    stack.start()
    return stack


def scrape(url: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (labels as printed)."""
    values = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in scrape(url).items():
        metric, _, label_text = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += value
    return total


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
