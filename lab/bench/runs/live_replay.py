"""``llm-epp-bench replay``: a trace replayed in real time through the live stack, config by config.

For each EndpointPickerConfig in turn, a fresh ``LocalStack`` (the stack ``make run`` starts:
simulated replicas with the ``default`` profile, and for the predicted-latency configs the
trainer and predictor sidecars; then the EPP and real Envoy) is sent the same requests: a fleet
workload (``bench.workloads.fleet_workloads``: the agentic-weka Claude Code sessions, a Mooncake slice,
...) turned into chat prompts in text by ``bench.workloads.replay_plan``. The replay is open loop: every
session starts at its time in the workload and each request is sent when it is due, whether
earlier ones have finished or not; a session's next turn is due the trace's think time after
its previous answer ended (or at its recorded offset). ``--rate-scale`` scales the load as the
workload defines it (session start rate, or arrival times); ``--duration`` stops sending new
requests that many seconds in, and the requests in flight run to the end.

Every request streams (``ignore_eos``, exactly the trace's output length) and is timed at the
client: TTFT to the first token, TPOT from the first to the last token over the tokens between,
E2E to the end of the stream. Reported per config (JSON, Markdown, PNG):

* TTFT / TPOT / E2E p50, p90, p99; errors; how late the client sent (it shares the CPUs);
* prefix-cache hit rate, from the responses' ``usage.prompt_tokens_details.cached_tokens`` and
  from the replicas' ``vllm:prefix_cache_hits`` / ``queries`` counters;
* CPU seconds of every process (EPP, Envoy, predictors, trainer, each replica) and of this
  client, over the replay;
* the requests the EPP routed on predictions and those that fell back to its heuristic, by
  reason (``llm_epp_prediction_fallback_total``), and when the first request was routed on
  predictions (each response's ``x-llm-epp-prediction-fallback`` debug header);
* the replicas' scheduling lag (``llm_epp_sim_step_lag_seconds``, how late each engine step
  started): CPU starvation of an engine shows there, not as a routing effect;
* the machine's load average over the replay (sampled every few seconds), so that a run on a
  busy machine is seen as one.

``--virtual`` replays the same workload and window in the fleet simulator instead (virtual
time, ``sim.fleet``: the same engine model and scheduling plugins, no processes), so the
machine's load does not enter: what each config should give at that load, against which a live
run's distortion can be judged.

``--rounds N`` replays the configs N times in turn (A, B, A, B, ...), each on a fresh stack, and
reports every run and, per round, each config's TTFT p50 / p99 against the first config's: on a
machine whose load changes from minute to minute, one run per config compares the minutes as
much as the configs.

Same seed for every config: the same workload and texts, the EPP's ``--seed``, the requests'
``seed``.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np
import orjson

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.progress import Progress

from bench.workloads.fleet_workloads import WorkloadOptions, build_workload
from bench.workloads.replay_plan import PlannedSession, PlannedTurn, PromptTexts, plan_sessions
from epp.configs import config_path
from epp.scheduling.config import EndpointPickerConfig
from epp.tokenizer.model import ModelTokenizer
from sim.engine.pool import describe_pool, pool_profiles
from sim.fleet import FleetConfig, FleetSimulator, SimulatedRequest, make_router
from sim.fleet.workload import Workload
from sim.measure import prometheus_samples as prom
from sim.measure.report import cell, machine, markdown_table, save_figure, style_latency_cdfs, write_results
from sim.models import TINY_MODEL_DIR
from sim.stack import LocalStack, StackConfig, StackPorts

DEFAULT_CONFIGS = ("gie-default", "predicted-latency", "predicted-latency-token-load")
PERCENTILES = (50, 90, 99)
STEP_LAG = "llm_epp_sim_step_lag_seconds"
SCHEDULING = "inference_extension_scheduler_e2e_duration_seconds"
PREDICTION_CALL = "llm_epp_prediction_call_duration_seconds"
PREDICTION_BATCH = "llm_epp_prediction_batch_requests"
HISTOGRAM_SETTLE_S = 1.5
LOAD_SAMPLE_S = 5.0
"""How often the machine's load average is sampled during a replay."""
"""The replicas re-render their histograms at most every second: wait that long before the last scrape."""
MODEL = "tiny"
DEBUG_HEADER = "x-llm-epp-debug"
FALLBACK_HEADER = "x-llm-epp-prediction-fallback"
ENDPOINT_HEADER = "x-llm-epp-endpoint"
PREDICTED_TTFT_HEADER = "x-llm-epp-predicted-ttft-ms"


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    workload: str = "agentic-weka"
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    rate_scale: float = 1.0
    duration_s: float = 150.0
    limit: int | None = None
    """First N sessions / requests of the workload (``bench.workloads.fleet_workloads``)."""
    seed: int = 0
    profile: str = "default"
    """Simulated engine profile (name or YAML path); ``make run``'s by default."""
    replicas: int = 4
    predictors: int = 2
    """Predictor sidecars for the configs that predict latency (the others run none)."""
    request_timeout_s: float = 600.0
    side_by_side: bool = False
    """Replay every config at the same time, each on its own stack, instead of one after another:
    on a machine whose other load changes from minute to minute, the configs then share the same
    conditions (and each other's CPU use, the predictor sidecars' included)."""
    rounds: int = 1
    """Times the configs are replayed in turn (A, B, A, B, ...), each run on a fresh stack."""


@dataclass(slots=True)
class RequestResult:
    session_id: str
    turn: int
    due_s: float
    """When the request was due, seconds from the start of the replay."""
    planned_prompt_tokens: int
    sent_s: float = 0.0
    end_s: float = 0.0
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    """Seconds per output token after the first; None for a one-token output."""
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    fallback: str | None = None
    """Why the EPP routed this request without predictions (its debug header); None if it did not."""
    endpoint: str | None = None
    """The endpoint the EPP picked (its debug header)."""
    predicted_ttft_ms: float | None = None
    """The EPP's predicted TTFT on that endpoint (its debug header); None without a prediction."""

    @property
    def ok(self) -> bool:
        return self.error is None


def plugin_types(config: str) -> set[str]:
    """The plugin types of ``config`` (a shipped name or a path)."""
    return {plugin.type for plugin in EndpointPickerConfig.from_file(config_path(config)).plugins}


def uses_predictor(config: str) -> bool:
    """Whether ``config`` routes on predicted latency (and so needs the trainer and predictors)."""
    return "predicted-latency-producer" in plugin_types(config)


# ---------------------------------------------------------------- the client


def _request_body(turn: PlannedTurn, seed: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": turn.chat_messages(),
            "max_tokens": turn.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send_turn(
    client: httpx.AsyncClient,
    url: str,
    result: RequestResult,
    body: bytes,
    headers: dict[str, str],
    start: float,
) -> RequestResult:
    """Stream one chat completion and time it into ``result`` (``error`` set unless it succeeded)."""
    first = last = None
    usage: dict[str, Any] | None = None
    sent = time.perf_counter()
    result.sent_s = sent - start
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            result.status = response.status_code
            result.fallback = response.headers.get(FALLBACK_HEADER)
            result.endpoint = response.headers.get(ENDPOINT_HEADER)
            if (predicted := response.headers.get(PREDICTED_TTFT_HEADER)) is not None:
                result.predicted_ttft_ms = float(predicted)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue  # blank separators and [DONE]
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        result.error = f"stream error: {str(event['error'])[:200]}"
                        break
                    choices = event.get("choices")
                    if choices and choices[0].get("delta", {}).get("content"):
                        last = time.perf_counter()
                        first = first or last
                    usage = event.get("usage") or usage
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    done = time.perf_counter()
    result.end_s = done - start
    if result.error is None and (first is None or last is None or usage is None):
        result.error = "the stream ended without tokens or usage"
    if result.error is not None or first is None or last is None or usage is None:
        return result
    result.ttft_s, result.e2e_s = first - sent, done - sent
    result.prompt_tokens = usage["prompt_tokens"]
    result.completion_tokens = usage["completion_tokens"]
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if result.completion_tokens > 1:
        result.tpot_s = (last - first) / (result.completion_tokens - 1)
    return result


@dataclass
class _Replay:
    client: httpx.AsyncClient
    url: str
    headers: dict[str, str]
    settings: ReplaySettings
    start: float
    groups_left: Counter[str]
    group_ended: dict[str, asyncio.Event]
    group_end_s: dict[str, float] = field(default_factory=dict)
    results: list[RequestResult] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def sleep_until(self, due_s: float) -> None:
        await asyncio.sleep(max(0.0, due_s - self.now()))

    def send(self, session: PlannedSession, turn: PlannedTurn, due_s: float) -> asyncio.Task[RequestResult]:
        result = RequestResult(session.session_id, turn.index, due_s, turn.prompt_tokens)
        self.results.append(result)
        headers = {**self.headers, "x-session-id": session.session_id}
        body = _request_body(turn, self.settings.seed)
        return asyncio.create_task(send_turn(self.client, self.url, result, body, headers, self.start))

    async def session(self, session: PlannedSession) -> None:
        base = 0.0
        if session.after is not None and session.after in self.group_ended:
            await self.group_ended[session.after].wait()
            base = self.group_end_s[session.after]
        begin = base + session.start_s
        sent: list[asyncio.Task[RequestResult]] = []
        for turn in session.turns:
            if turn.offset_s is not None:
                due = begin + turn.offset_s
            elif sent:
                due = (await sent[-1]).end_s + turn.think_s
            else:
                due = begin
            if due >= self.settings.duration_s:
                break
            await self.sleep_until(due)
            sent.append(self.send(session, turn, due))
        await asyncio.gather(*sent)
        self.groups_left[session.group] -= 1
        if session.group and self.groups_left[session.group] == 0:
            self.group_end_s[session.group] = self.now()
            self.group_ended[session.group].set()


async def sample_load(samples: list[float], interval_s: float = LOAD_SAMPLE_S) -> None:
    """Append the machine's 1-minute load average to ``samples`` every ``interval_s``, until cancelled."""
    while True:
        samples.append(os.getloadavg()[0])
        await asyncio.sleep(interval_s)


async def replay(
    gateway_url: str,
    sessions: list[PlannedSession],
    workload: Workload,
    settings: ReplaySettings,
    load_samples: list[float] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every planned request that falls due within the duration; results and wall seconds.
    The machine's load average is appended to ``load_samples`` meanwhile."""
    headers = {"content-type": "application/json", DEBUG_HEADER: "true"}
    if workload.slo_ttft_ms is not None:
        headers["x-slo-ttft-ms"] = f"{workload.slo_ttft_ms:g}"
    if workload.slo_tpot_ms is not None:
        headers["x-slo-tpot-ms"] = f"{workload.slo_tpot_ms:g}"
    groups = Counter(session.group for session in sessions)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=settings.request_timeout_s) as client:
        state = _Replay(
            client,
            f"{gateway_url}/v1/chat/completions",
            headers,
            settings,
            time.perf_counter(),
            groups,
            {group: asyncio.Event() for group in groups if group},
        )
        sampler = asyncio.create_task(sample_load([] if load_samples is None else load_samples))
        try:
            await asyncio.gather(*(state.session(session) for session in sessions))
        finally:
            sampler.cancel()
        return state.results, state.now()


# ---------------------------------------------------------------- one config


@dataclass
class Snapshot:
    cpu_s: dict[str, float]
    """CPU seconds by process name (``epp``, ``envoy``, ``trainer``, ``predictor-0``, ``replica-0``, ...)."""
    epp: prom.Samples
    replicas: list[prom.Samples]


def snapshot(stack: LocalStack) -> Snapshot:
    return Snapshot(
        {component.name: component.cpu_seconds() for component in stack.components()},
        prom.scrape(stack.epp_metrics_url),
        [prom.scrape(f"{stack.replica_url(i)}/metrics") for i in range(len(stack.replicas))],
    )


def run_config(
    config: str,
    sessions: list[PlannedSession],
    workload: Workload,
    settings: ReplaySettings,
    progress: Progress | None = None,
    round_: int = 1,
) -> dict[str, Any]:
    """Replay on a fresh stack running ``config``; the config's summary (see ``summarize``),
    marked with its round."""
    types = plugin_types(config)
    predicted = "predicted-latency-producer" in types
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            ports=StackPorts.free(),
            sim_profile=settings.profile,
            epp_config=config,
            predictors=settings.predictors if predicted else 0,
            epp_args=["--log-level", "WARNING", "--seed", str(settings.seed)],
            kv_events=any(t.startswith("precise-prefix-cache") for t in types),
        )
    )
    try:
        stack.start()
        before = snapshot(stack)
        client_cpu = time.thread_time()  # this config's client alone, also when configs run side by side
        label = f"replay {config}" + (f" (round {round_})" if settings.rounds > 1 else "")
        task = progress.add_task(label, total=None) if progress is not None else None
        load: list[float] = []
        results, wall_s = asyncio.run(replay(stack.gateway_url, sessions, workload, settings, load))
        client_cpu = time.thread_time() - client_cpu
        if progress is not None and task is not None:
            progress.update(task, description=f"{label}: {len(results)} requests in {wall_s:.0f} s")
        time.sleep(HISTOGRAM_SETTLE_S)
        after = snapshot(stack)
    finally:
        stack.stop()
    return {"round": round_, **summarize(config, predicted, results, before, after, wall_s, client_cpu, load)}


# ---------------------------------------------------------------- summaries


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": round(float(np.percentile(values, p)) * 1e3, 3) for p in PERCENTILES}


def _error_kind(error: str) -> str:
    return re.split(r"[:(]", error, maxsplit=1)[0].strip()


def _step_lag(buckets: list[tuple[float, float]]) -> dict[str, Any]:
    steps = buckets[-1][1] if buckets else 0.0

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    return {
        "steps": steps,
        "p50_ms": ms(prom.quantile(buckets, 0.5)),
        "p99_ms": ms(prom.quantile(buckets, 0.99)),
        "share_over_10ms": prom.share_above(buckets, 0.01) if steps else None,
        "share_over_50ms": prom.share_above(buckets, 0.05) if steps else None,
        "buckets": [[bound, count] for bound, count in buckets if bound != float("inf")],
    }


def _prediction_error(ok: list[RequestResult]) -> dict[str, Any]:
    """How far the EPP's TTFT prediction for the picked endpoint was from the client's TTFT
    (relative error; the client's TTFT also holds Envoy's and the EPP's time)."""
    errors = [
        abs(r.predicted_ttft_ms - r.ttft_s * 1e3) / (r.ttft_s * 1e3)
        for r in ok
        if r.predicted_ttft_ms is not None and r.ttft_s
    ]
    if not errors:
        return {"requests": 0, "p50": None, "p90": None, "mean": None}
    return {
        "requests": len(errors),
        "p50": round(float(np.percentile(errors, 50)), 4),
        "p90": round(float(np.percentile(errors, 90)), 4),
        "mean": round(float(np.mean(errors)), 4),
    }


def _histogram_ms(samples: prom.Samples, name: str) -> dict[str, float | None]:
    """Count, p50 and p99 (ms) of a seconds histogram."""
    buckets = prom.histogram(samples, name)
    p50, p99 = prom.quantile(buckets, 0.5), prom.quantile(buckets, 0.99)
    return {
        "count": buckets[-1][1] if buckets else 0.0,
        "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
        "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
    }


def _load_average(samples: list[float]) -> dict[str, float | int | None]:
    """Mean and highest of the 1-minute load averages sampled during a replay."""
    if not samples:
        return {"samples": 0, "mean": None, "max": None}
    return {"samples": len(samples), "mean": round(float(np.mean(samples)), 2), "max": round(max(samples), 2)}


def _session_moves(results: list[RequestResult]) -> dict[str, int]:
    """Turns after a session's first sent to another endpoint than the session's previous turn."""
    last: dict[str, str] = {}
    moved = stayed = 0
    for r in sorted(results, key=lambda r: (r.session_id, r.turn)):
        if r.endpoint is None:
            continue
        previous = last.get(r.session_id)
        if previous is not None:
            moved += previous != r.endpoint
            stayed += previous == r.endpoint
        last[r.session_id] = r.endpoint
    return {"moved": moved, "stayed": stayed}


def summarize(
    config: str,
    predicted: bool,
    results: list[RequestResult],
    before: Snapshot,
    after: Snapshot,
    wall_s: float,
    client_cpu_s: float,
    load_samples: list[float] | None = None,
) -> dict[str, Any]:
    """Everything reported for one config, from the client's results and the processes' metrics
    (and the machine's load average sampled during the replay)."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    replicas = [prom.delta(b, a) for b, a in zip(before.replicas, after.replicas, strict=True)]
    queries = sum(prom.total(r, "vllm:prefix_cache_queries_total") for r in replicas)
    hits = sum(prom.total(r, "vllm:prefix_cache_hits_total") for r in replicas)
    lags = [prom.histogram(r, STEP_LAG) for r in replicas]
    epp = prom.delta(before.epp, after.epp)
    epp_requests = prom.total(epp, "inference_objective_request_total")
    fallbacks = prom.by_label(epp, "llm_epp_prediction_fallback_total", "reason")
    cpu = {name: round(seconds - before.cpu_s.get(name, 0.0), 3) for name, seconds in after.cpu_s.items()}
    cpu["client"] = round(client_cpu_s, 3)
    return {
        "config": config,
        "predicts_latency": predicted,
        "wall_s": round(wall_s, 3),
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(Counter(_error_kind(r.error) for r in results if r.error is not None)),
        "error_samples": sorted({r.error for r in results if r.error is not None})[:5],
        "ttft_ms": _percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_ms_by_turn": {
            "first": _percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None and r.turn == 0]),
            "later": _percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0]),
        },
        "session_moves": _session_moves(results),
        "tpot_ms": _percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": _percentiles_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "send_lag_ms": _percentiles_ms([max(0.0, r.sent_s - r.due_s) for r in results]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prompt_tokens_as_planned": sum(r.prompt_tokens == r.planned_prompt_tokens for r in ok),
        "hit_rate_client": round(cached / prompt, 4) if prompt else None,
        "hit_rate_engines": round(hits / queries, 4) if queries else None,
        "requests_per_replica": [round(prom.total(r, "vllm:request_success_total")) for r in replicas],
        "cpu_s": cpu,
        "load_average": _load_average(load_samples or []),
        "epp": {
            "requests": epp_requests,
            "fallbacks": fallbacks,
            "predicted_share": (
                round(1 - sum(fallbacks.values()) / epp_requests, 4) if predicted and epp_requests else None
            ),
            "first_predicted_s": (
                min((r.sent_s for r in ok if r.fallback is None), default=None) if predicted else None
            ),
            "ttft_prediction_error": _prediction_error(ok),
            "scheduling": _histogram_ms(epp, SCHEDULING),
            "prediction_calls": _histogram_ms(epp, PREDICTION_CALL),
            "requests_per_prediction_call": (
                round(batched / calls, 3)
                if (calls := prom.total(epp, f"{PREDICTION_BATCH}_count"))
                and (batched := prom.total(epp, f"{PREDICTION_BATCH}_sum"))
                else None
            ),
        },
        "step_lag": {
            "all": _step_lag(prom.merge(lags)),
            "per_replica": [_step_lag(buckets) for buckets in lags],
        },
        "records": [asdict(r) for r in results],
    }


# ---------------------------------------------------------------- the benchmark


def build(settings: ReplaySettings) -> tuple[Workload, list[PlannedSession]]:
    """The workload at the settings' scale, seed and limit, and as chat prompts its sessions that
    start within the duration."""
    window = min(
        profile.engine.max_model_len for profile in pool_profiles(settings.profile, settings.replicas)
    )
    options = WorkloadOptions(
        scale=settings.rate_scale, seed=settings.seed, limit=settings.limit, max_model_len=window
    )
    workload = build_workload(settings.workload, options)
    # Sessions that start after the duration send nothing: leave them unplanned.
    workload.sessions = [
        session
        for session in workload.sessions
        if session.after is not None or session.start_s < settings.duration_s
    ]
    return workload, plan_sessions(workload, PromptTexts(ModelTokenizer(TINY_MODEL_DIR)), window)


def run(
    settings: ReplaySettings, out_dir: Path, plan: tuple[Workload, list[PlannedSession]] | None = None
) -> dict[str, Any]:
    """Replay ``plan`` (default: ``build(settings)``) with every config, ``settings.rounds``
    times in turn; write the report."""
    workload, sessions = plan or build(settings)
    results: list[dict[str, Any]] = []
    with Progress(refresh_per_second=1) as progress:
        for round_ in range(1, settings.rounds + 1):
            if settings.side_by_side:
                with ThreadPoolExecutor(len(settings.configs)) as pool:
                    futures = [
                        pool.submit(run_config, config, sessions, workload, settings, progress, round_)
                        for config in settings.configs
                    ]
                    results += [future.result() for future in futures]
            else:
                results += [
                    run_config(config, sessions, workload, settings, progress, round_)
                    for config in settings.configs
                ]
    engines = describe_pool(pool_profiles(settings.profile, settings.replicas))
    data = {
        "benchmark": "replay",
        "settings": asdict(settings),
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "params": workload.params,
            "sessions_within_duration": len(sessions),
        },
        "slo": {"ttft_ms": workload.slo_ttft_ms, "tpot_ms": workload.slo_tpot_ms},
        "profile": {"name": settings.profile, "description": " ".join(p["description"] for p in engines)},
        "pool": engines,
        "machine": machine(),
        "results": results,
    }
    stem = "replay-" + re.sub(r"[^A-Za-z0-9._-]+", "_", workload.name.split(":")[0])
    plots = _plots(out_dir, stem, results, settings)
    write_results(out_dir, stem, data, _markdown(data, plots))
    return data


def _ttft_summary(records: list[SimulatedRequest]) -> dict[str, Any]:
    """TTFT percentiles (ms) of simulated requests, all and split into first and later turns."""
    timed = [(r.turn, r.ttft) for r in records if r.ttft is not None]
    return {
        "requests": len(timed),
        "ttft_ms": _percentiles_ms([t for _, t in timed]),
        "ttft_ms_by_turn": {
            "first": _percentiles_ms([t for turn, t in timed if turn == 0]),
            "later": _percentiles_ms([t for turn, t in timed if turn > 0]),
        },
    }


def run_virtual(settings: ReplaySettings, out_dir: Path, workload: Workload | None = None) -> dict[str, Any]:
    """The replay's workload (default: ``build(settings)``'s) through the fleet simulator, in
    virtual time, once per config (router names of ``sim.fleet``): the TTFT of the requests that
    arrive within the duration, engine-side (no EPP, Envoy or client time); write the report."""
    workload = workload or build(settings)[0]
    fleet = FleetConfig(replicas=settings.replicas, profile=settings.profile, seed=settings.seed)
    results = []
    for config in settings.configs:
        simulator = FleetSimulator(
            workload, lambda clock, config=config: make_router(config, clock, settings.seed), fleet
        )
        within = [r for r in simulator.run().records if r.arrival < settings.duration_s]
        results.append({"config": config, **_ttft_summary(within)})
    data = {
        "benchmark": "replay-virtual",
        "settings": asdict(settings),
        "workload": {"name": workload.name, "description": workload.description, "params": workload.params},
        "machine": machine(),
        "results": results,
    }
    stem = "replay-virtual-" + re.sub(r"[^A-Za-z0-9._-]+", "_", workload.name.split(":")[0])
    write_results(out_dir, stem, data, _virtual_markdown(data))
    return data


def _virtual_markdown(data: dict[str, Any]) -> str:
    settings, results = data["settings"], data["results"]
    reference = results[0]["ttft_ms"]
    table = markdown_table(
        ["config", "requests", "TTFT p50/p90/p99 ms", "vs the first config p50 / p99",
         "first turns p50/p90/p99 ms", "later turns p50/p90/p99 ms"],
        [
            [
                r["config"],
                cell(r["requests"]),
                _triple(r["ttft_ms"], digits=1),
                f"{_change(r['ttft_ms']['p50'], reference['p50'])} / "
                f"{_change(r['ttft_ms']['p99'], reference['p99'])}"
                if r is not results[0]
                else "–",
                _triple(r["ttft_ms_by_turn"]["first"], digits=1),
                _triple(r["ttft_ms_by_turn"]["later"], digits=1),
            ]
            for r in results
        ],
    )  # fmt: skip
    return "\n".join(
        [
            f"# Replay in virtual time: {data['workload']['name']}",
            "",
            f"- {data['workload']['description']}; the requests that arrive within the first "
            f"{settings['duration_s']:g} s (rate scale {settings['rate_scale']:g}, seed {settings['seed']}), "
            f"on {settings['replicas']} simulated engines, profile **{settings['profile']}**, in the fleet "
            "simulator: virtual time, so the machine's load does not enter. TTFT is the engines' (arrival "
            "to first token), without the EPP's, Envoy's or a client's time.",
            "",
            table,
        ]
    )


# ---------------------------------------------------------------- report


def _triple(values: dict[str, float | None], scale: float = 1.0, digits: int = 0) -> str:
    return "/".join(
        cell(None if values[f"p{p}"] is None else values[f"p{p}"] * scale, digits) for p in PERCENTILES
    )


def _cpu_groups(cpu: dict[str, float]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for name, seconds in cpu.items():
        group = re.sub(r"-\d+$", "s", name)  # predictor-0 -> predictors, replica-1 -> replicas
        groups[group] = round(groups.get(group, 0.0) + seconds, 3)
    return groups


def _label(result: dict[str, Any], rounds: int) -> str:
    """A run's name in the report: its config, and its round where there are several."""
    return result["config"] + (f" #{result['round']}" if rounds > 1 else "")


def _change(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "–"
    return f"{(value / reference - 1) * 100:+.1f}%"


def rounds_table(results: list[dict[str, Any]]) -> str:
    """Per round, each config's TTFT p50 / p99 and its change against the round's first config,
    with the engines' step-lag p99 and the load average that say how starved the run was."""
    first: dict[int, dict[str, Any]] = {}
    rows = []
    for r in results:
        reference = first.setdefault(r["round"], r)
        ttft, base = r["ttft_ms"], reference["ttft_ms"]
        rows.append(
            [
                cell(r["round"]),
                r["config"],
                f"{cell(ttft['p50'], 1)} / {cell(ttft['p99'], 1)}",
                f"{_change(ttft['p50'], base['p50'])} / {_change(ttft['p99'], base['p99'])}"
                if r is not reference
                else "–",
                cell(r["step_lag"]["all"]["p99_ms"], 1),
                f"{cell(r['load_average']['mean'], 1)} / {cell(r['load_average']['max'], 1)}",
            ]
        )
    return markdown_table(
        ["round", "config", "TTFT p50 / p99 ms", "vs the round's first config", "step lag p99 ms",
         "load average mean / max"],
        rows,
    )  # fmt: skip


def _markdown(data: dict[str, Any], plots: list[str]) -> str:
    settings, results = data["settings"], data["results"]
    latency = markdown_table(
        ["config", "requests ok/sent", "errors", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
         "E2E p50/p90/p99 s", "hit rate (usage / engines)", "routed on predictions", "send lag p99 ms"],
        [
            [
                _label(r, settings["rounds"]),
                f"{r['completed']}/{r['requests']}",
                ", ".join(f"{kind} ×{n}" for kind, n in r["errors"].items()) or "0",
                _triple(r["ttft_ms"], digits=1),
                _triple(r["tpot_ms"], digits=1),
                _triple(r["e2e_ms"], 1e-3, 2),
                f"{cell(r['hit_rate_client'], 3)} / {cell(r['hit_rate_engines'], 3)}",
                cell(r["epp"]["predicted_share"], 3),
                cell(r["send_lag_ms"]["p99"], 1),
            ]
            for r in results
        ],
    )  # fmt: skip
    groups = [_cpu_groups(r["cpu_s"]) for r in results]
    columns = ["epp", "envoy", "predictors", "trainer", "replicas", "client"]
    cpu = markdown_table(
        ["config", *(f"{c} CPU s" for c in columns), "EPP CPU ms/request"],
        [
            [
                _label(r, settings["rounds"]),
                *(cell(g.get(c), 2) for c in columns),
                cell(g["epp"] / r["requests"] * 1e3 if r["requests"] else None, 2),
            ]
            for r, g in zip(results, groups, strict=True)
        ],
    )
    lag = markdown_table(
        ["config", "engine steps", "lag p50 ms", "lag p99 ms", "steps > 10 ms late", "steps > 50 ms late",
         "worst replica p99 ms", "requests per replica", "load average mean / max"],
        [
            [
                _label(r, settings["rounds"]),
                cell(r["step_lag"]["all"]["steps"]),
                cell(r["step_lag"]["all"]["p50_ms"], 2),
                cell(r["step_lag"]["all"]["p99_ms"], 1),
                cell(r["step_lag"]["all"]["share_over_10ms"], 4),
                cell(r["step_lag"]["all"]["share_over_50ms"], 4),
                cell(max((x["p99_ms"] or 0.0 for x in r["step_lag"]["per_replica"]), default=None), 1),
                " / ".join(str(n) for n in r["requests_per_replica"]),
                f"{cell(r['load_average']['mean'], 1)} / {cell(r['load_average']['max'], 1)}",
            ]
            for r in results
        ],
    )  # fmt: skip
    routing = markdown_table(
        ["config", "TTFT p50/p90/p99 ms, first turns", "TTFT p50/p90/p99 ms, later turns",
         "later turns moved / stayed", "EPP scheduling p50 / p99 ms"],
        [
            [
                _label(r, settings["rounds"]),
                _triple(r["ttft_ms_by_turn"]["first"], digits=1),
                _triple(r["ttft_ms_by_turn"]["later"], digits=1),
                f"{r['session_moves']['moved']} / {r['session_moves']['stayed']}",
                f"{cell(r['epp']['scheduling']['p50_ms'], 2)} / {cell(r['epp']['scheduling']['p99_ms'], 2)}",
            ]
            for r in results
        ],
    )  # fmt: skip
    fallbacks = markdown_table(
        [
            "config",
            "EPP requests",
            "fallbacks by reason",
            "first routed on predictions (s into the replay)",
            "TTFT prediction error p50/p90 (picked endpoint vs client)",
            "predictor calls: p50 / p99 ms",
            "requests per call",
        ],
        [
            [
                _label(r, settings["rounds"]),
                cell(r["epp"]["requests"]),
                ", ".join(f"{k} {v:g}" for k, v in sorted(r["epp"]["fallbacks"].items())) or "none",
                cell(r["epp"]["first_predicted_s"], 1),
                f"{cell(r['epp']['ttft_prediction_error']['p50'], 3)} / "
                f"{cell(r['epp']['ttft_prediction_error']['p90'], 3)}",
                f"{cell(r['epp']['prediction_calls']['count'])}: "
                f"{cell(r['epp']['prediction_calls']['p50_ms'], 1)} / "
                f"{cell(r['epp']['prediction_calls']['p99_ms'], 1)}",
                cell(r["epp"]["requests_per_prediction_call"], 2),
            ]
            for r in results
            if r["predicts_latency"]
        ],
    )
    m, workload, slo = data["machine"], data["workload"], data["slo"]
    lines = [
        f"# Live replay: {workload['name']}",
        "",
        f"- {workload['description']}; of these, the {workload['sessions_within_duration']} sessions that "
        f"start within the first {settings['duration_s']:g} s send their requests that fall due by then "
        f"(rate scale {settings['rate_scale']:g}, seed {settings['seed']}).",
        f"- Stack per config (fresh each time): {settings['replicas']} simulated replicas, profile "
        f"**{data['profile']['name']}**; {settings['predictors']} predictors and a trainer for the configs "
        "that predict latency; the EPP; real Envoy. Requests carry the workload's SLO headers "
        f"(TTFT {cell(slo['ttft_ms'])} ms, TPOT {cell(slo['tpot_ms'])} ms). The configs ran "
        + (
            "side by side, each on its own stack at the same time (sharing the CPUs and each other's load)."
            if settings["side_by_side"]
            else "one after another."
        )
        + (
            f" This was repeated {settings['rounds']} times, in turn, each run on a fresh stack."
            if settings["rounds"] > 1
            else ""
        ),
        f"- Machine: {m['cpus']} CPUs, Python {m['python']}, Envoy {m['envoy']}, {m['date']}. The client "
        "shares the CPUs with every process of the stack.",
        "",
        "## Latency (client-side, streamed)",
        "",
        latency,
        "",
        *(
            [
                f"## {settings['rounds']} rounds: each config against the round's first",
                "",
                rounds_table(results),
                "",
            ]
            if settings["rounds"] > 1
            else []
        ),
        "## Routing: first turns (no cache anywhere) and later turns (cached where the session was)",
        "",
        routing,
        "",
        "## CPU over the replay",
        "",
        cpu,
        "",
        "## Simulated engines: scheduling lag (how late each engine step started)",
        "",
        lag,
        "",
    ]
    if any(r["predicts_latency"] for r in results):
        lines += ["## Predictions vs heuristic fallback (EPP metrics)", "", fallbacks, ""]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines)


def _plots(out_dir: Path, stem: str, results: list[dict[str, Any]], settings: ReplaySettings) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        ok = [rec for rec in r["records"] if rec["error"] is None]
        for axis, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), strict=True):
            values = np.sort([rec[key] for rec in ok if rec[key] is not None])
            if len(values):
                axis.plot(
                    values, np.arange(1, len(values) + 1) / len(values), label=_label(r, settings.rounds)
                )
    style_latency_cdfs(axes)
    figure.suptitle(f"Live replay, rate scale {settings.rate_scale:g}: client-side latency CDFs")
    names = [save_figure(figure, out_dir, f"{stem}-cdf.png")]

    figure, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for r in results:
        ok = [rec for rec in r["records"] if rec["ttft_s"] is not None]
        axes[0].scatter(
            [rec["sent_s"] for rec in ok],
            [rec["ttft_s"] for rec in ok],
            s=6,
            label=_label(r, settings.rounds),
        )
    axes[0].set_yscale("log")
    axes[0].set_xlabel("sent at (s into the replay)")
    axes[0].set_ylabel("TTFT (s)")
    axes[0].set_title("TTFT over the replay (predictor warm-up shows here)")
    axes[0].legend(fontsize=8)
    groups = [_cpu_groups(r["cpu_s"]) for r in results]
    bottom = np.zeros(len(results))
    for column in ("epp", "envoy", "predictors", "trainer", "replicas", "client"):
        heights = np.array([g.get(column, 0.0) for g in groups])
        axes[1].bar([_label(r, settings.rounds) for r in results], heights, bottom=bottom, label=column)
        bottom += heights
    axes[1].set_ylabel("CPU seconds over the replay")
    axes[1].set_title("CPU by process")
    axes[1].legend(fontsize=8)
    axes[1].tick_params(axis="x", labelsize=7)
    for r in results:
        lag = r["step_lag"]["all"]
        if lag["steps"]:
            bounds = [bound * 1e3 for bound, _ in lag["buckets"]]
            later = [1 - count / lag["steps"] for _, count in lag["buckets"]]
            axes[2].step(bounds, later, where="post", marker=".", label=_label(r, settings.rounds))
    axes[2].set_xscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("lag (ms)")
    axes[2].set_ylabel("share of engine steps started later than that")
    axes[2].set_title("How late the simulated engines' steps started (all replicas)")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    names.append(save_figure(figure, out_dir, f"{stem}-stack.png"))
    return names
