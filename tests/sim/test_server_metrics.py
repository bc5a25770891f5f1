"""/metrics: vLLM 0.32's names, types, labels and buckets, and values that follow the traffic."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from sim.engine import Engine, EngineRequest, load_profile
from sim.engine.profile import PROFILES_DIR
from sim.host_cpu import HostCpu
from sim.metrics import EngineMetricsExporter
from sim.openai_serving import ServedModel
from tests.support import eventually

from .conftest import FIXTURES, running_replica

REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"})
RECORDED_ON = HostCpu("the x86 CPU with AVX-512 BF16 and AMX of metrics_full.txt", AVX512_BF16 | {"amx_tile"})
AVX2_ONLY = HostCpu("an x86 CPU with AVX2 and no AVX-512", frozenset({"avx", "avx2", "fma"}))


def families(text: str) -> dict[str, Metric]:
    return {
        family.name: family
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:")
    }


def value(parsed: dict[str, Metric], sample_name: str, **labels: str) -> float:
    family_name = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for sample in parsed[family_name].samples:
        if sample.name == sample_name and labels.items() <= sample.labels.items():
            return sample.value
    raise KeyError(sample_name)


def buckets(family: Metric) -> list[str]:
    return [sample.labels["le"] for sample in family.samples if sample.name.endswith("_bucket")]


async def scrape(http: httpx.AsyncClient) -> dict[str, Metric]:
    response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return families(response.text)


async def test_names_types_labels_and_buckets_match_vllm(served_model: ServedModel) -> None:
    recorded = families((FIXTURES / "metrics_full.txt").read_text())
    async with (
        running_replica(served_model, cpu=RECORDED_ON) as (_, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        ours = await scrape(http)
    assert {name: ours[name].type for name in REQUIRED} == REQUIRED
    for name, family in ours.items():
        assert family.type == recorded[name].type, name
        recorded_labels = {frozenset(s.labels) for s in recorded[name].samples}
        assert {frozenset(s.labels) for s in family.samples} <= recorded_labels, name
        if family.type == "histogram":
            assert buckets(family) == buckets(recorded[name]), name
    # vLLM's whole CacheConfig: the same values, but for the memory size the simulator has not.
    info = ours["vllm:cache_config_info"].samples[0].labels
    recorded_info = recorded["vllm:cache_config_info"].samples[0].labels
    assert {key for key in info if info[key] != recorded_info[key]} == {"kv_cache_memory_bytes"}
    assert ours["vllm:num_requests_running"].samples[0].labels == {"model_name": "tiny", "engine": "0"}


def cache_config(engine: Engine, cpu: HostCpu) -> dict[str, str]:
    rendered = families(EngineMetricsExporter(engine, "tiny", cpu=cpu).render().decode())
    return rendered["vllm:cache_config_info"].samples[0].labels


def test_the_cache_config_follows_vllms_cpu_rule(served_model: ServedModel) -> None:
    profile = load_profile("instant")
    engine = Engine(profile.engine, profile.cost, served_model.output_vocab)
    with_bf16, avx2 = cache_config(engine, RECORDED_ON), cache_config(engine, AVX2_ONLY)
    # vLLM's CPU platform resets the SSM cache dtype to float32 only where AVX-512 BF16 runs its
    # accelerated GDN kernels; elsewhere it stays auto. Nothing else in the cache config moves.
    assert (with_bf16["mamba_ssm_cache_dtype"], avx2["mamba_ssm_cache_dtype"]) == ("float32", "auto")
    assert {key for key in with_bf16 if with_bf16[key] != avx2[key]} == {"mamba_ssm_cache_dtype"}
    no_amx = HostCpu("an x86 CPU with AVX-512 BF16 and no AMX", AVX512_BF16)
    assert cache_config(engine, no_amx)["mamba_ssm_cache_dtype"] == "float32"


async def test_counters_and_histograms_follow_requests(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        before = await scrape(http)
        payload = {"prompt": list(range(300, 432)), "max_tokens": 2}  # 132 tokens; the repeat hits 128
        for _ in range(2):
            await http.post("/v1/completions", json=payload)
        await http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers={"x-sim-output-tokens": "1"}
        )
        after = await scrape(http)

    def delta(sample_name: str, **labels: str) -> float:
        return value(after, sample_name, **labels) - value(before, sample_name, **labels)

    prompt_hi = len(served_model.tokenizer.encode("hi"))
    assert delta("vllm:prompt_tokens_total") == 264 + prompt_hi
    assert delta("vllm:prefix_cache_queries_total") == 264 + prompt_hi
    assert delta("vllm:prefix_cache_hits_total") == 128
    assert delta("vllm:prompt_tokens_cached_total") == 128
    assert delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 128
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") == 136 + prompt_hi
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == 136 + prompt_hi
    # Steps that produced tokens: each request's prefill step plus one decode step for two of them.
    assert delta("vllm:iteration_tokens_total_count") == 5
    assert delta("vllm:iteration_tokens_total_sum") == 136 + prompt_hi + 5


async def test_gauges_show_running_waiting_and_kv_usage(served_model: ServedModel) -> None:
    async with (
        running_replica(served_model, profile="default", max_num_seqs=1) as (replica, url),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        payload = {"prompt": "hello " * 100, "max_tokens": 2000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=payload) as first:
            lines = first.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            second = asyncio.create_task(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
            await eventually(lambda: replica.engine.num_waiting == 1)
            parsed = await scrape(http)
            assert value(parsed, "vllm:num_requests_running") == 1
            assert value(parsed, "vllm:num_requests_waiting") == 1
            assert value(parsed, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
            assert value(parsed, "vllm:kv_cache_usage_perc") == replica.engine.kv_usage > 0
        assert (await second).json()["usage"]["completion_tokens"] == 1
        parsed = await scrape(http)
        assert value(parsed, "vllm:num_requests_running") == value(parsed, "vllm:kv_cache_usage_perc") == 0


async def test_preemptions_are_counted_and_requests_still_complete(served_model: ServedModel) -> None:
    # 8 usable blocks of 32 (256 tokens); two requests that each grow to 213 tokens cannot both fit.
    async with (
        running_replica(served_model, num_gpu_blocks=9) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        payloads = [{"prompt": list(range(start, start + 64)), "max_tokens": 150} for start in (100, 500)]
        responses = await asyncio.gather(*(http.post("/v1/completions", json=p) for p in payloads))
        assert [r.json()["usage"]["completion_tokens"] for r in responses] == [150, 150]
        parsed = await scrape(http)
        assert value(parsed, "vllm:num_preemptions_total") >= 1
        assert value(parsed, "vllm:request_num_preemptions_sum") >= 1


async def test_histograms_may_lag_but_counters_do_not(served_model: ServedModel) -> None:
    now = [0.0]
    profile = load_profile("instant")
    engine = Engine(profile.engine, profile.cost, served_model.output_vocab)
    metrics = EngineMetricsExporter(engine, "tiny", histogram_refresh_s=1.0, clock=lambda: now[0])
    first = families(metrics.render().decode())
    engine.add_request(EngineRequest("a", [1, 2, 3], 1), 0.0)
    step = engine.schedule(0.0)
    metrics.record_step(engine.finish_step(step, step.end_time))
    stale = families(metrics.render().decode())
    assert value(stale, "vllm:generation_tokens_total") == 1
    assert value(stale, "vllm:e2e_request_latency_seconds_count") == value(
        first, "vllm:e2e_request_latency_seconds_count"
    )
    now[0] = 1.0
    fresh = families(metrics.render().decode())
    assert value(fresh, "vllm:e2e_request_latency_seconds_count") == 1


async def test_frontend_delay_counts_in_ttft_not_in_the_engine_queue(
    served_model: ServedModel, tmp_path: Path
) -> None:
    document = yaml.safe_load((PROFILES_DIR / "instant.yaml").read_text())
    document["frontend_ms"] = {"base": 150.0, "per_prompt_token": 1.0}  # 150 + 50 ms
    profile = tmp_path / "delayed.yaml"
    profile.write_text(yaml.safe_dump(document))
    replica = running_replica(served_model, str(profile))
    async with replica as (_, url), httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/completions", json={"prompt": list(range(300, 350)), "max_tokens": 2})
        after = await scrape(http)
    # Lower bounds only: the delay is a sleep, so it is never shorter.
    assert value(after, "vllm:time_to_first_token_seconds_sum") >= 0.2
    assert value(after, "vllm:request_queue_time_seconds_sum") < value(
        after, "vllm:time_to_first_token_seconds_sum"
    )
