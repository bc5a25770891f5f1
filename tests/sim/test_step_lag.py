"""``llm_epp_sim_step_lag_seconds``: how late the simulated engine's steps start; and
``llm_epp_sim_engine_busy_seconds_total``: how long they were modelled to take."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sim.driver import EngineDriver
from sim.engine import EngineRequest
from sim.metrics import EngineMetricsExporter
from sim.openai_serving import ServedModel

from .conftest import make_engine, prompt, running_replica

LAG = "llm_epp_sim_step_lag_seconds"


def samples(text: str, family_name: str) -> dict[str, float]:
    """``{sample name + le: value}`` of one family."""
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            return {s.name + s.labels.get("le", ""): s.value for s in family.samples}
    raise KeyError(family_name)


async def test_every_step_of_a_served_request_is_counted(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert response.status_code == 200
        text = (await http.get("/metrics")).text
    lag = samples(text, LAG)
    # One request of 5 tokens: its prefill step and 4 decode steps, each of which produced tokens.
    assert lag[f"{LAG}_count"] == 5
    steps = samples(text, "vllm:iteration_tokens_total")["vllm:iteration_tokens_total_count"]
    assert lag[f"{LAG}_count"] == steps
    assert lag[f"{LAG}_bucket+Inf"] == 5
    assert lag[f"{LAG}_sum"] >= 0


async def test_the_modelled_busy_time_of_served_steps_is_exported(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (replica, url), httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert response.status_code == 200
        text = (await http.get("/metrics")).text
    [busy] = samples(text, "llm_epp_sim_engine_busy_seconds").values()
    assert busy > 0
    assert busy == replica.engine.counters.busy_seconds


async def test_a_blocked_event_loop_shows_as_step_lag() -> None:
    engine = make_engine()
    metrics = EngineMetricsExporter(engine, "tiny", histogram_refresh_s=0.0)
    driver = EngineDriver(engine, on_step=metrics.record_step, on_step_lag=metrics.record_step_lag)
    stream = driver.submit(EngineRequest("a", prompt(8), 4))
    # Queued behind the driver's first step: the loop is blocked for 0.2 s while the step runs
    # (about 1 ms of engine time), as a replica starved of CPU would be.
    asyncio.get_running_loop().call_soon(time.sleep, 0.2)
    outputs = [output async for output in stream]
    await driver.stop()
    lag = samples(metrics.render().decode(), LAG)
    assert len(outputs) == 4  # prefill + 3 decode steps, one output each
    assert lag[f"{LAG}_count"] == 4
    assert lag[f"{LAG}_bucket0.1"] <= 3  # at least one step started 0.1 s or more late
    assert lag[f"{LAG}_sum"] >= 0.19
