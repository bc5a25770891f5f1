"""Helpers shared by the tiers that start real processes: stacks on free ports, metric reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from sim.stack import LocalStack, StackConfig, StackPorts


class CheckedStack(LocalStack):
    """A stack whose EPP checks every tokenization it reuses against a full one (the differential
    check of ``epp.tokenizer_cache``): ``stop()`` fails if any differed."""

    def stop(self) -> None:
        mismatches = sum(
            metric_sum(url, "llm_epp_tokenizer_cache_mismatches_total")
            for epp, url in zip(self.epps, self.epp_metrics_urls, strict=False)
            if epp.alive()
        )
        super().stop()
        assert mismatches == 0, f"the EPP's tokenizer cache gave {mismatches:.0f} wrong tokenizations"


def start_stack(workdir: Path, replicas: int, **overrides) -> LocalStack:
    """Start a gateway stack on free ports, its EPP verifying its tokenizer cache; the caller stops it."""
    overrides["epp_args"] = [*overrides.get("epp_args", ()), "--verify-tokenizer-cache"]
    config = StackConfig(replicas=replicas, ports=StackPorts.free(), workdir=workdir, **overrides)
    stack = CheckedStack(config)
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
