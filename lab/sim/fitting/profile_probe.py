"""Measuring a served engine from outside, for ``sim.fitting.profile_fit``.

Step durations come from the real engine's own clock, read from vLLM's /metrics as the change of
a histogram's ``_sum`` and ``_count`` across one measurement:

* a prefill step: ``vllm:request_prefill_time_seconds`` (scheduled → first token) of a one-token
  request, sent alone (a prefill-only step) or while other requests decode (a mixed step);
* a steady decode step of n sequences: ``vllm:inter_token_latency_seconds`` over a window in
  which n streams decode and nothing else runs.

A request's intake (``IntakeTerms``: the engine time it takes outside its steps) comes from the
engine process's own CPU clocks over a one-token request sent alone: the time its other threads
(input and output) ran, and the time its main thread ran beyond the request's step.

Each step is net of the time the engine's thread waited for a CPU meanwhile
(``sim.fitting.cpu_contention``; per step: the wait over the measurement divided by the steps in it, from
``vllm:iteration_tokens_total``), so other work on the machine does not end up in the profile.

The same one-token requests, alone and among n decoding "background" streams, are then sent to
the simulator running the fitted steps with no frontend delay; what their time to first token
lacks against vLLM's, in the same situation, is the frontend delay (``profile_fit.fit_frontend``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from sim.engine.cost_model import chunk_context_tokens
from sim.fitting.completions import PromptMaker, completion_body, stream_completion
from sim.fitting.cpu_contention import oncpu_s, runqueue_wait_s, sibling_threads_oncpu_s, wait_until_idle
from sim.fitting.profile_fit import FrontendSample, IntakeSample, StepSample
from sim.fitting.servers import RunningServer, sim_server, vllm_server
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
    """Prompt lengths of the requests sent alone, each ``repeats`` times."""
    background_streams: tuple[int, ...] = (1, 4, 8, 16, 32)
    """How many requests decode while the ``loaded_prefill_lengths`` requests are sent."""
    loaded_prefill_lengths: tuple[int, ...] = (64, 768, 1536)
    repeats: int = 4
    background_prompt_tokens: int = 64
    decode_batches: tuple[tuple[int, int], ...] = (
        (1, 32), (1, 1024), (1, 1500), (2, 512), (4, 32), (4, 1500), (8, 512), (8, 1024),
        (12, 768), (16, 32), (16, 512), (24, 256), (32, 32), (32, 256), (48, 32),
    )  # fmt: skip
    """(sequences, prompt tokens) of each steady decode batch, all within the KV cache."""
    decode_repeats: int = 2
    settle_s: float = 0.1
    window_s: float = 0.5
    seed: int = 7

    def segments(self) -> list[tuple[int, list[int]]]:
        """(background streams, prompt lengths in sending order) of the request probe; lengths are
        shuffled so that drift hits all alike."""
        rng = random.Random(self.seed)
        plan = [(0, list(self.prefill_lengths))] + [
            (n, list(self.loaded_prefill_lengths)) for n in self.background_streams
        ]
        return [(n, rng.sample(lengths * self.repeats, len(lengths) * self.repeats)) for n, lengths in plan]

    @property
    def probes(self) -> int:
        """How often ``measure_vllm`` and ``measure_sim`` together call ``advance``."""
        requests = sum(len(lengths) for _, lengths in self.segments())
        return 2 * requests + len(self.decode_batches) * self.decode_repeats


@dataclass(frozen=True, slots=True)
class ProbedRequest:
    """A one-token request sent while ``running`` other requests decode.

    ``queue_ms`` and ``prefill_ms`` are the engine's (vLLM's /metrics, net of CPU waits),
    ``decode_context`` the context of the decoding requests then, and ``intake_ms`` the engine's
    time for it outside its step (measured only when it runs alone); not read on the simulator.
    """

    running: int
    prompt_tokens: int
    ttft_ms: float
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_context: int = 0
    intake_ms: float = 0.0

    def step(self) -> StepSample:
        """The step that prefilled this request (with the running requests' decodes)."""
        pairs = chunk_context_tokens(self.prompt_tokens, 0)
        kind = "mixed" if self.running else "prefill"
        return StepSample(kind, self.prompt_tokens, pairs, self.running, self.decode_context, self.prefill_ms)


@dataclass
class VllmMeasurements:
    scheduler: dict[str, Any]
    """vLLM's resolved scheduler settings for the replica's command line."""
    requests: list[ProbedRequest] = field(default_factory=list)
    decode_steps: list[StepSample] = field(default_factory=list)
    dropped: int = 0
    """Measurements discarded: vLLM preempted (its KV cache ran out) or its engine thread waited
    for a CPU too long (``MAX_WAIT_SHARE``)."""
    engine_wait_pct: float = 0.0
    """Share of the engine thread's time spent waiting for a CPU in the decode windows (mean),
    taken out of the step samples."""
    load_average: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average before and after."""

    @property
    def steps(self) -> list[StepSample]:
        return [r.step() for r in self.requests] + self.decode_steps

    @property
    def intake(self) -> list[IntakeSample]:
        """The intake of the requests sent alone."""
        return [IntakeSample(r.prompt_tokens, r.intake_ms) for r in self.requests if r.running == 0]


def frontend_samples(real: Sequence[ProbedRequest], sim: Sequence[ProbedRequest]) -> list[FrontendSample]:
    """Median TTFT per (running requests, prompt length) on both servers, where both have some."""
    cells: dict[tuple[int, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for side, requests in enumerate((real, sim)):
        for r in requests:
            cells[r.running, r.prompt_tokens][side].append(r.ttft_ms)
    return [
        FrontendSample(tokens, running, float(np.median(ttfts)), float(np.median(sim_ttfts)))
        for (running, tokens), (ttfts, sim_ttfts) in sorted(cells.items())
        if ttfts and sim_ttfts
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


async def _engine_timed(
    session: aiohttp.ClientSession, server: RunningServer, prompt: str, running: int, context_base: float
) -> ProbedRequest | None:
    """Stream a one-token completion, reading the engine's queue and prefill time for it; None
    if /metrics did not see exactly this request finish, or the engine waited too long for a CPU.
    The running requests' decode context is ``context_base`` plus the server's generated tokens."""
    before = await snapshot(session, server)
    main_cpu, siblings_cpu = oncpu_s(server.engine_pid), sibling_threads_oncpu_s(server.engine_pid)
    timing = await stream_completion(session, server.url, prompt, 1)
    count = before[f"{PREFILL_TIME}_count"]
    after = await snapshot_when(session, server, lambda s: s[f"{PREFILL_TIME}_count"] > count)
    if after[f"{PREFILL_TIME}_count"] - count != 1:
        return None
    main_cpu = oncpu_s(server.engine_pid) - main_cpu
    siblings_cpu = sibling_threads_oncpu_s(server.engine_pid) - siblings_cpu
    wait_ms = before.wait_per_step_ms(after)
    prefill_ms = 1000 * (after[f"{PREFILL_TIME}_sum"] - before[f"{PREFILL_TIME}_sum"])
    if wait_ms > MAX_WAIT_SHARE * prefill_ms:
        return None
    # Alone, the main thread runs nothing but this request: its time beyond the step is intake.
    step_ms = prefill_ms - wait_ms
    intake_ms = 0.0 if running else 1000 * siblings_cpu + max(0.0, 1000 * main_cpu - step_ms)
    return ProbedRequest(
        running,
        timing.prompt_tokens,
        1000 * timing.ttft_s,
        queue_ms=1000 * (after[f"{QUEUE_TIME}_sum"] - before[f"{QUEUE_TIME}_sum"]),
        prefill_ms=step_ms,
        decode_context=round(context_base + before[GENERATED]) if running else 0,
        intake_ms=intake_ms,
    )


async def _decode_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, started: asyncio.Event
) -> None:
    async with session.post(f"{url}/v1/completions", json=completion_body(prompt, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                started.set()


@dataclass
class _Background:
    """Requests decoding on a server (one per prompt of ``prompt_tokens``), started together and
    aborted on exit; entered once all have their first token and ``settle_s`` has passed."""

    session: aiohttp.ClientSession
    server: RunningServer
    prompts: list[str]
    prompt_tokens: int
    settle_s: float
    streams: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> _Background:
        started = [asyncio.Event() for _ in self.prompts]
        max_tokens = MAX_MODEL_LEN - self.prompt_tokens - 8  # as long as can be: they are aborted
        self.streams = [
            asyncio.create_task(_decode_stream(self.session, self.server.url, prompt, max_tokens, event))
            for prompt, event in zip(self.prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=60)
        await asyncio.sleep(self.settle_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for stream in self.streams:
            stream.cancel()  # closing the connection aborts the request
        await asyncio.gather(*self.streams, return_exceptions=True)
        idle = "vllm:num_requests_running", "vllm:num_requests_waiting"
        await snapshot_when(self.session, self.server, lambda s: s[idle[0]] + s[idle[1]] == 0, 30.0)


async def probe_requests(
    session: aiohttp.ClientSession,
    server: RunningServer,
    plan: ProbePlan,
    *,
    engine_clock: bool,
    advance: Callable[[], None],
) -> tuple[list[ProbedRequest], int]:
    """``plan.segments()``: one-token requests one after another, among n background streams;
    with ``engine_clock`` (vLLM) also the engine's times. The requests kept, and how many were
    dropped (a segment in which vLLM preempted is dropped whole)."""
    prompts = PromptMaker(plan.seed)
    kept: list[ProbedRequest] = []
    dropped = 0
    for running, lengths in plan.segments():
        background = [prompts.text(plan.background_prompt_tokens) for _ in range(running)]
        texts = [prompts.text(length) for length in lengths]
        start = await snapshot(session, server)
        segment: list[ProbedRequest] = []
        async with _Background(session, server, background, plan.background_prompt_tokens, plan.settle_s):
            # The background's decode tokens attend to its prompts and everything it generated.
            ready = await snapshot(session, server)
            context_base = ready[PROMPT] - start[PROMPT] - start[GENERATED]
            for text in texts:
                if engine_clock:
                    probed = await _engine_timed(session, server, text, running, context_base)
                else:
                    timing = await stream_completion(session, server.url, text, 1)
                    probed = ProbedRequest(running, timing.prompt_tokens, 1000 * timing.ttft_s)
                if probed is None:
                    dropped += 1
                else:
                    segment.append(probed)
                advance()
        if engine_clock and (await snapshot(session, server))[PREEMPTIONS] > start[PREEMPTIONS]:
            dropped += len(segment)
        else:
            kept += segment
    return kept, dropped


async def probe_decode_batch(
    session: aiohttp.ClientSession,
    server: RunningServer,
    prompts: PromptMaker,
    num_seqs: int,
    prompt_tokens: int,
    plan: ProbePlan,
) -> tuple[StepSample | None, float]:
    """A steady decode step of ``num_seqs`` sequences (None if vLLM preempted or its engine
    waited too long for a CPU), and the share of the window (%) the engine waited for a CPU."""
    start = await snapshot(session, server)
    batch = [prompts.text(prompt_tokens) for _ in range(num_seqs)]
    async with _Background(session, server, batch, prompt_tokens, plan.settle_s):
        first = await snapshot(session, server)
        await asyncio.sleep(plan.window_s)
        last = await snapshot(session, server)
    # A window always holds tokens: every sequence decodes throughout it.
    step_ms = (
        1000
        * (last[f"{INTER_TOKEN}_sum"] - first[f"{INTER_TOKEN}_sum"])
        / (last[f"{INTER_TOKEN}_count"] - first[f"{INTER_TOKEN}_count"])
    )
    wait_ms = first.wait_per_step_ms(last)
    preempted = (await snapshot(session, server))[PREEMPTIONS] > start[PREEMPTIONS]
    if preempted or wait_ms > MAX_WAIT_SHARE * step_ms:
        return None, 100 * wait_ms / step_ms
    # Context at the middle of the window: every prompt, and every token generated by then.
    context = last[PROMPT] - start[PROMPT] + (first[GENERATED] + last[GENERATED]) / 2 - start[GENERATED]
    return StepSample("decode", 0, 0, num_seqs, round(context), step_ms - wait_ms), 100 * wait_ms / step_ms


def measure_vllm(plan: ProbePlan, workdir: Path, advance: Callable[[], None]) -> VllmMeasurements:
    """Start real vLLM; probe requests alone and among background streams, then decode batches.
    Starts once the machine is idle (or has not become so within a while)."""
    wait_until_idle()
    load_before = os.getloadavg()[0]
    measured = VllmMeasurements(scheduler=vllm_scheduler_limits(VllmReplicaSpec(port=0, workdir=workdir)))
    waits: list[float] = []

    async def probe(server: RunningServer) -> None:
        async with aiohttp.ClientSession() as session:
            measured.requests, measured.dropped = await probe_requests(
                session, server, plan, engine_clock=True, advance=advance
            )
            prompts = PromptMaker(plan.seed + 1)
            for _ in range(plan.decode_repeats):
                for num_seqs, prompt_tokens in plan.decode_batches:
                    sample, wait_pct = await probe_decode_batch(
                        session, server, prompts, num_seqs, prompt_tokens, plan
                    )
                    waits.append(wait_pct)
                    if sample is None:
                        measured.dropped += 1
                    else:
                        measured.decode_steps.append(sample)
                    advance()

    with vllm_server(workdir) as server:
        asyncio.run(probe(server))
    measured.engine_wait_pct = float(np.mean(waits))
    measured.load_average = (load_before, os.getloadavg()[0])
    return measured


def measure_sim(
    plan: ProbePlan, workdir: Path, profile: Path, advance: Callable[[], None]
) -> list[ProbedRequest]:
    """The same requests as ``measure_vllm`` sends alone and among background streams, on the
    simulator running ``profile``: client TTFT only."""

    async def probe(server: RunningServer) -> list[ProbedRequest]:
        async with aiohttp.ClientSession() as session:
            requests, _ = await probe_requests(session, server, plan, engine_clock=False, advance=advance)
            return requests

    with sim_server(workdir, profile) as server:
        return asyncio.run(probe(server))
