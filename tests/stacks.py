"""Stacks on free ports for the tiers that start real processes."""

from __future__ import annotations

from pathlib import Path

from sim.stack import LocalStack, StackConfig, StackPorts
from tests.support import metric_sum, wait_for


class CheckedStack(LocalStack):
    """A stack whose EPP checks every tokenization it reuses against a full one (the differential
    check of ``epp.tokenizer.cache``): ``stop()`` fails if any differed."""

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


def requests_settled(stack: LocalStack) -> bool:
    """Every earlier request finished: their access-log entries (flushed up to 100 ms after
    the answer) are in, so counters read now move only with the next request."""
    return wait_for(lambda: metric_sum(stack.epp_metrics_url, "llm_epp_endpoint_in_flight_requests") == 0)
