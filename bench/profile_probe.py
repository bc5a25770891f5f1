"""Measuring a served engine from outside, for ``bench.profile_fit``.

Step durations come from the real engine's own clock, read from vLLM's /metrics as the change of
a histogram's ``_sum`` and ``_count`` across one measurement:

* a lone request's prefill step: ``vllm:request_prefill_time_seconds`` (scheduled → first token);
* a steady decode step of n sequences: ``vllm:inter_token_latency_seconds`` over a window in
  which n streams decode and nothing else runs;
* a step mixing a prefill into such a batch: the prefill time of a one-token request sent into it.

Each is net of the time the engine's thread waited for a CPU meanwhile (``bench.schedstat``; per
step: the wait over the measurement divided by the steps in it, from
``vllm:iteration_tokens_total``), so other work on the machine does not end up in the profile.

The client's time to first token of the lone requests comes from the stream
(``bench.completions``); what it has beyond the engine's queue + prefill time is the server's
front end. The simulated server's own share of that is measured the same way on a simulator
whose steps take no time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.completions import PromptMaker, completion_body, stream_completion
from bench.profile_fit import FrontendSample, StepSample, lone_prefill
from bench.schedstat import runqueue_wait_s
from bench.servers import RunningServer, sim_server, vllm_server
from sim.engine import load_profile
from sim.engine.cost_model import chunk_context_tokens
from sim.real_vllm import MAX_MODEL_LEN, VllmReplicaSpec, vllm_python

# Resolves the scheduler settings exactly as the server does for the same command line.
_SCHEDULER_LIMITS = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
s = config.scheduler_config
print(json.dumps({"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                  "chunked_prefill": s.enable_chunked_prefill, "async_scheduling": s.async_scheduling,
                  "policy": str(s.policy)}))
"""

PREFILL_TIME = "vllm:request_prefill_time_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
INTER_TOKEN = "vllm:inter_token_latency_seconds"
STEPS = "vllm:iteration_tokens_total_count"
GENERATED = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
MAX_WAIT_SHARE = 0.5
"""A step measurement whose engine thread waited for a CPU longer than this share of it is
dropped: the correction would be most of it."""


@dataclass(frozen=True)
class ProbePlan:
    prefill_lengths: tuple[int, ...] = (16, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2000)
    prefill_repeats: int = 5
    decode_batches: tuple[tuple[int, int], ...] = (
        (1, 32), (1, 1024), (1, 1500), (2, 512), (4, 32), (4, 1500), (8, 512), (8, 1024),
        (12, 768), (16, 32), (16, 512), (24, 256), (32, 32), (32, 256), (48, 32),
    )  # fmt: skip
    """(sequences, prompt tokens) of each steady decode batch, all within the KV cache."""
    decode_repeats: int = 2
    mixed_prefill_lengths: tuple[int, ...] = (64, 1024)
    """Prompt lengths sent into each decode batch once its window is measured."""
    settle_s: float = 0.1
    window_s: float = 0.5
    seed: int = 7


@dataclass(frozen=True, slots=True)
class LonePrefill:
    """One request alone on the server, one output token.

    ``queue_ms`` and ``prefill_ms`` are the engine's (vLLM's /metrics, net of CPU waits), None
    where not read (the simulator).
    """

    prompt_tokens: int
    ttft_ms: float
    queue_ms: float | None = None
    prefill_ms: float | None = None


@dataclass
class Measurements:
    """Everything ``measure`` saw; ``steps`` and ``frontend_samples()`` feed ``fit_profile``."""

    scheduler: dict[str, Any]
    lone_vllm: list[LonePrefill] = field(default_factory=list)
    lone_sim: list[LonePrefill] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)
    dropped_batches: int = 0
    """Decode batches discarded because vLLM preempted a sequence (the KV cache ran out)."""
    engine_wait_pct: float = 0.0
    """Share of the engine thread's time spent waiting for a CPU in the decode windows (mean),
    taken out of the step samples."""
    sim_step_ms: float = 0.0
    """The step time of the zero-cost profile the simulator's own overhead was measured with."""
    load_average: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average before and after."""

    def frontend_samples(self) -> list[FrontendSample]:
        """vLLM's lone requests, each with the simulator's median own overhead at that length."""
        by_length: dict[int, list[float]] = defaultdict(list)
        for sample in self.lone_sim:
            by_length[sample.prompt_tokens].append(sample.ttft_ms - self.sim_step_ms)
        own = {length: float(np.median(values)) for length, values in by_length.items()}
        return [
            FrontendSample(
                s.prompt_tokens, s.ttft_ms, (s.queue_ms or 0.0) + (s.prefill_ms or 0.0), own[s.prompt_tokens]
            )
            for s in self.lone_vllm
            if s.prompt_tokens in own
        ]


def vllm_scheduler_limits(spec: VllmReplicaSpec) -> dict[str, Any]:
    """vLLM's resolved scheduler settings for ``spec``'s command line (about 10 s: imports vLLM)."""
    argv = spec.argv()
    server_args = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    result = subprocess.run(
        [str(vllm_python()), "-c", _SCHEDULER_LIMITS, *server_args],
        env={**os.environ, **spec.env()},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A server's metrics (every sample but histogram buckets, summed over label sets) and its
    engine thread's CPU wait so far, at one moment."""

    metrics: dict[str, float]
    engine_wait_s: float

    def __getitem__(self, name: str) -> float:
        return self.metrics[name]

    def wait_per_step_ms(self, later: Snapshot) -> float:
        """The engine thread's CPU wait per engine step between the two snapshots."""
        steps = later[STEPS] - self[STEPS]
        return 1000 * (later.engine_wait_s - self.engine_wait_s) / steps if steps else 0.0


async def snapshot(session: aiohttp.ClientSession, server: RunningServer) -> Snapshot:
    async with session.get(f"{server.url}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                values[sample.name] += sample.value
    return Snapshot(values, runqueue_wait_s(server.engine_pid))


async def snapshot_when(
    session: aiohttp.ClientSession,
    server: RunningServer,
    ready: Callable[[Snapshot], bool],
    timeout: float = 2.0,
) -> Snapshot:
    """A snapshot once ``ready`` holds (or the timeout passed): vLLM records a finished request
    just after it streamed it."""
    deadline = time.monotonic() + timeout
    while not ready(now := await snapshot(session, server)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return now


async def engine_timed_prefill(
    session: aiohttp.ClientSession, server: RunningServer, prompt: str
) -> LonePrefill | None:
    """Stream a one-token completion and read the engine's queue and prefill time for it; None
    if /metrics did not see exactly this request finish, or its engine waited too long for a CPU."""
    before = await snapshot(session, server)
    timing = await stream_completion(session, server.url, prompt, 1)
    after = await snapshot_when(
        session, server, lambda s: s[f"{PREFILL_TIME}_count"] > before[f"{PREFILL_TIME}_count"]
    )
    if after[f"{PREFILL_TIME}_count"] - before[f"{PREFILL_TIME}_count"] != 1:
        return None
    wait_ms = before.wait_per_step_ms(after)
    prefill_ms = 1000 * (after[f"{PREFILL_TIME}_sum"] - before[f"{PREFILL_TIME}_sum"])
    if wait_ms > MAX_WAIT_SHARE * prefill_ms:
        return None
    return LonePrefill(
        timing.prompt_tokens,
        1000 * timing.ttft_s,
        queue_ms=1000 * (after[f"{QUEUE_TIME}_sum"] - before[f"{QUEUE_TIME}_sum"]),
        prefill_ms=prefill_ms - wait_ms,
    )


async def probe_lone_prefills(
    session: aiohttp.ClientSession,
    server: RunningServer,
    plan: ProbePlan,
    *,
    engine_clock: bool,
    advance: Callable[[], None],
) -> list[LonePrefill]:
    """One request at a time, one output token, prompt lengths shuffled (drift hits all alike).
    Without ``engine_clock`` (the simulator) only the client's TTFT."""
    prompts = PromptMaker(plan.seed)
    lengths = list(plan.prefill_lengths) * plan.prefill_repeats
    random.Random(plan.seed).shuffle(lengths)
    samples = []
    for length in lengths:
        text = prompts.text(length)
        if engine_clock:
            if (sample := await engine_timed_prefill(session, server, text)) is not None:
                samples.append(sample)
        else:
            timing = await stream_completion(session, server.url, text, 1)
            samples.append(LonePrefill(timing.prompt_tokens, 1000 * timing.ttft_s))
        advance()
    return samples


async def _decode_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, started: asyncio.Event
) -> None:
    async with session.post(f"{url}/v1/completions", json=completion_body(prompt, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                started.set()


async def probe_decode_batch(
    session: aiohttp.ClientSession,
    server: RunningServer,
    prompts: PromptMaker,
    num_seqs: int,
    prompt_tokens: int,
    plan: ProbePlan,
) -> tuple[list[StepSample], float] | None:
    """A steady decode step of ``num_seqs`` sequences, then one mixed step per
    ``plan.mixed_prefill_lengths``, and the share of the decode window (%) the engine thread
    waited for a CPU; None if vLLM preempted (the batch did not fit its KV cache)."""
    start = await snapshot(session, server)
    started = [asyncio.Event() for _ in range(num_seqs)]
    max_tokens = MAX_MODEL_LEN - prompt_tokens - 8  # more than the window needs; aborted after it
    streams = [
        asyncio.create_task(
            _decode_stream(session, server.url, prompts.text(prompt_tokens), max_tokens, event)
        )
        for event in started
    ]
    samples: list[StepSample] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=60)
        await asyncio.sleep(plan.settle_s)
        first = await snapshot(session, server)
        await asyncio.sleep(plan.window_s)
        last = await snapshot(session, server)
        prompt = (first[PROMPT] - start[PROMPT]) / num_seqs

        def context(s: Snapshot) -> int:
            """Tokens the batch's decode tokens attend to at ``s``: prompt and output so far."""
            return round(num_seqs * prompt + s[GENERATED] - start[GENERATED])

        # A window always holds tokens: every sequence decodes throughout it.
        tokens = last[f"{INTER_TOKEN}_count"] - first[f"{INTER_TOKEN}_count"]
        wait_ms = first.wait_per_step_ms(last)
        step_ms = 1000 * (last[f"{INTER_TOKEN}_sum"] - first[f"{INTER_TOKEN}_sum"]) / tokens
        if wait_ms <= MAX_WAIT_SHARE * step_ms:
            mid = (context(first) + context(last)) // 2
            samples.append(StepSample("decode", 0, 0, num_seqs, mid, step_ms - wait_ms))
        for length in plan.mixed_prefill_lengths:
            decode_context = context(await snapshot(session, server))
            lone = await engine_timed_prefill(session, server, prompts.text(length))
            if lone is not None and lone.prefill_ms is not None:
                pairs = chunk_context_tokens(lone.prompt_tokens, 0)
                samples.append(
                    StepSample("mixed", lone.prompt_tokens, pairs, num_seqs, decode_context, lone.prefill_ms)
                )
    finally:
        for stream in streams:
            stream.cancel()  # closing the connection aborts the request
        await asyncio.gather(*streams, return_exceptions=True)
        await snapshot_when(
            session,
            server,
            lambda s: s["vllm:num_requests_running"] + s["vllm:num_requests_waiting"] == 0,
            30.0,
        )
    end = await snapshot(session, server)
    if end[PREEMPTIONS] > start[PREEMPTIONS]:
        return None
    return samples, 100 * wait_ms / step_ms


def total_probes(plan: ProbePlan) -> int:
    """How often ``measure`` calls ``advance``."""
    lone = len(plan.prefill_lengths) * plan.prefill_repeats
    return 2 * lone + len(plan.decode_batches) * plan.decode_repeats


def measure(plan: ProbePlan, workdir: Path, advance: Callable[[], None]) -> Measurements:
    """Start real vLLM, measure lone prefills and decode batches; then, on a simulator whose steps
    take no time, the same lone requests. ``advance`` is called after each lone request and each
    decode batch."""
    load_before = os.getloadavg()[0]
    measurements = Measurements(scheduler=vllm_scheduler_limits(VllmReplicaSpec(port=0, workdir=workdir)))
    waits: list[float] = []

    async def on_vllm(server: RunningServer) -> None:
        async with aiohttp.ClientSession() as session:
            measurements.lone_vllm = await probe_lone_prefills(
                session, server, plan, engine_clock=True, advance=advance
            )
            prompts = PromptMaker(plan.seed + 1)
            for _ in range(plan.decode_repeats):
                for num_seqs, prompt_tokens in plan.decode_batches:
                    result = await probe_decode_batch(session, server, prompts, num_seqs, prompt_tokens, plan)
                    if result is None:
                        measurements.dropped_batches += 1
                    else:
                        measurements.steps += result[0]
                        waits.append(result[1])
                    advance()

    async def on_sim(server: RunningServer) -> None:
        async with aiohttp.ClientSession() as session:
            measurements.lone_sim = await probe_lone_prefills(
                session, server, plan, engine_clock=False, advance=advance
            )

    with vllm_server(workdir) as server:
        asyncio.run(on_vllm(server))
    measurements.steps += [
        lone_prefill(s.prompt_tokens, s.prefill_ms)
        for s in measurements.lone_vllm
        if s.prefill_ms is not None
    ]
    measurements.engine_wait_pct = float(np.mean(waits)) if waits else 0.0
    zero_cost = load_profile("instant")
    measurements.sim_step_ms = 1000 * zero_cost.cost.step_time(1, 1, 0, 0, 0.0)
    with sim_server(workdir, "instant") as server:
        asyncio.run(on_sim(server))
    measurements.load_average = (load_before, os.getloadavg()[0])
    return measurements
