"""Fixtures for the simulated model server: small engines, the served tiny model, live servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from epp.tokenizer.model import ModelTokenizer
from sim.engine import DecodeTerms, Engine, EngineConfig, EngineRequest, PrefillTerms, StepCostModel
from sim.engine.engine import RequestOutput, ScheduledStep
from sim.host_cpu import HostCpu
from sim.kv_events import KVEventsConfig
from sim.models import TINY_MODEL_DIR
from sim.openai_serving import ServedModel
from sim.server import ServerSettings, SimulatedVllm
from tests.support import serving

# Milliseconds: a prefill step costs 1 + 0.01 per token, a decode step 1.
TEST_COST = StepCostModel(PrefillTerms(base=1.0, per_token=0.01), DecodeTerms(base=1.0, min=1.0))
TEST_VOCAB = range(100, 200)


def make_engine(**overrides: Any) -> Engine:
    """A small engine: 4-token blocks, 64 usable blocks, a 64-token budget, KV events on."""
    settings = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "block_size": 4,
        "num_gpu_blocks": 65,
        "max_model_len": 256,
        "enable_kv_events": True,
    }
    settings.update(overrides)
    return Engine(EngineConfig(**settings), TEST_COST, TEST_VOCAB)


def prompt(length: int, start: int = 1000) -> list[int]:
    return list(range(start, start + length))


class EngineRun:
    """Steps an engine in virtual time and keeps everything it produced."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0
        self.steps: list[ScheduledStep] = []
        self.outputs: dict[str, list[RequestOutput]] = {}

    def add(self, *requests: EngineRequest) -> None:
        for request in requests:
            self.engine.add_request(request, self.now)

    def step(self) -> ScheduledStep | None:
        step = self.engine.schedule(self.now)
        if step is None:
            return None
        self.now = step.end_time
        self.steps.append(step)
        for output in self.engine.finish_step(step, self.now):
            self.outputs.setdefault(output.request.request_id, []).append(output)
        return step

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            assert self.step() is not None, "unfinished requests but nothing schedulable"
        raise AssertionError("engine did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [token for output in self.outputs.get(request_id, []) for token in output.new_token_ids]


@pytest.fixture(scope="session")
def served_model() -> ServedModel:
    return ServedModel(ModelTokenizer(TINY_MODEL_DIR), "tiny", "sim/models/tiny")


# Sized like the recorded vLLM 0.32 run: 2048-token context, 512 blocks of 32 (16,384 tokens).
VLLM_LIKE = {"max_model_len": 2048, "block_size": 32, "num_gpu_blocks": 512}


@asynccontextmanager
async def running_replica(
    served_model: ServedModel,
    profile: str = "instant",
    *,
    kv_events: KVEventsConfig | None = None,
    index: int = 0,
    cpu: HostCpu | None = None,
    **engine_overrides: Any,
) -> AsyncIterator[tuple[SimulatedVllm, str]]:
    """Replica ``index`` of a server, served by uvicorn on a free loopback port, in this event loop.

    Histograms are re-rendered on every scrape, so tests see them current.
    """
    settings = ServerSettings(
        profile=profile,
        engine_overrides={**VLLM_LIKE, **engine_overrides},
        histogram_refresh_s=0.0,
        kv_events=kv_events or KVEventsConfig(),
        cpu=cpu,
    )
    replica = SimulatedVllm(settings, served_model, index)
    async with serving(replica.app) as url:
        yield replica, url


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"


def vllm_samples() -> dict[str, str]:
    """Sections of the recorded vLLM 0.32 responses (samples.txt), by their ``###`` title."""
    sections: dict[str, list[str]] = {}
    title = ""
    for line in (FIXTURES / "samples.txt").read_text().splitlines():
        if line.startswith("### "):
            title = line[4:]
            sections[title] = []
        elif title:
            sections[title].append(line)
    return {name: "\n".join(lines).strip() for name, lines in sections.items()}


def vllm_error_sample(title: str) -> tuple[dict[str, Any], int]:
    """A recorded error body and its status (the line ends with `` [status]``)."""
    body, _, status = vllm_samples()[title].rpartition(" [")
    return json.loads(body), int(status.rstrip("]"))
