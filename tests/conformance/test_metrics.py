"""/metrics: every simulated metric as vLLM exports it, and the router's inputs moving alike."""

from __future__ import annotations

import time

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Served, on_each, random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

# What the router scrapes (vLLM's Prometheus names; counters without their _total suffix).
ROUTER_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:cache_config_info": "gauge",
}
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
    "vllm:generation_tokens",
)
SETTLE_TIMEOUT_S = 30.0
"""A bound, not a speed: vLLM counts a step within milliseconds of it, on any CPU."""


def scrape(engine: Served) -> dict[str, Metric]:
    families = text_string_to_metric_families(engine.http.get("/metrics").text)
    return {family.name: family for family in families if family.name.startswith("vllm:")}


def label_names(family: Metric) -> set[frozenset[str]]:
    return {frozenset(sample.labels) for sample in family.samples}


def buckets(family: Metric) -> list[str]:
    return [sample.labels["le"] for sample in family.samples if sample.name.endswith("_bucket")]


def counter_values(engine: Served) -> dict[str, float]:
    families = scrape(engine)
    return {name: sum(sample.value for sample in families[name].samples if sample.name.endswith("_total"))
            for name in COUNTERS}  # fmt: skip


def test_every_simulated_metric_is_a_vllm_metric(engines: dict[str, Served]) -> None:
    for engine in engines.values():
        engine.complete("def main():", max_tokens=3)
    sim, vllm = scrape(engines["sim"]), scrape(engines["vllm"])
    for name, family in sim.items():
        assert name in vllm, name
        assert family.type == vllm[name].type, name
        assert label_names(family) == label_names(vllm[name]), name
        if family.type == "histogram":
            assert buckets(family) == buckets(vllm[name]), name


def test_the_routers_metrics_agree(engines: dict[str, Served]) -> None:
    scraped = on_each(engines, scrape)
    for name, kind in ROUTER_METRICS.items():
        families = {engine: scraped[engine][name] for engine in scraped}
        assert {engine: family.type for engine, family in families.items()} == {"sim": kind, "vllm": kind}
        assert label_names(families["sim"]) == label_names(families["vllm"]), name
    info = on_each(engines, lambda engine: scraped[engine.name]["vllm:cache_config_info"].samples[0].labels)
    assert (info["sim"]["block_size"], info["sim"]["num_gpu_blocks"]) == ("32", "512")
    # The whole CacheConfig agrees, but for the memory size: the simulator is sized in blocks.
    differing = {key for key in info["sim"] if info["sim"][key] != info["vllm"][key]}
    assert differing == {"kv_cache_memory_bytes"}


def test_token_and_prefix_cache_counters_count_alike(engines: dict[str, Served]) -> None:
    prompt = random_prompt(132, seed=2)

    def deltas(engine: Served) -> dict[str, float]:
        engine.reset_prefix_cache()
        before = counter_values(engine)
        for _ in range(2):
            engine.complete(prompt)
        # vLLM may count a step's stats just after answering: wait (boundedly) for the last token.
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        after = counter_values(engine)
        while (
            after["vllm:generation_tokens"] - before["vllm:generation_tokens"] < 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
            after = counter_values(engine)
        return {name: after[name] - before[name] for name in COUNTERS}

    counted = on_each(engines, deltas)
    assert counted["sim"] == counted["vllm"]
    assert counted["sim"] == {
        "vllm:prefix_cache_queries": 264,
        "vllm:prefix_cache_hits": 128,
        "vllm:prompt_tokens": 264,
        "vllm:prompt_tokens_cached": 128,
        "vllm:generation_tokens": 2,
    }
