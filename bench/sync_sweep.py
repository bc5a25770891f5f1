"""``llm-epp-bench sync-sweep``: what replica sync is worth, K EPP replicas × sync delay d.

Each workload is replayed on the fleet simulator by one router (K = 1), then by K EPP replicas
of the same config (``sim.fleet.router_replicas``: round-robin like Envoy, each with its own
state) synced with each delay d, or never synced. Every run sees the same workload (same seed,
arrivals and tokens) on the same engines. Writes ``sync-sweep.json`` (every metric of
``bench.fleet_metrics`` per run, plus the settings), ``sync-sweep.md`` (one table per workload,
with each run's p99 E2E and TTFT p99 against the single router's, and the goal: 4 replicas
synced at 50 ms within 3% of one router) and ``sync-sweep.png`` (p99 E2E against K).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.fleet_metrics import summarize
from bench.fleet_workloads import WorkloadOptions, build_workload
from bench.report import cell, machine, markdown_table, save_figure, write_results
from sim.engine import load_profile
from sim.fleet import FleetConfig, FleetSimulator, make_router

GOAL_REPLICAS, GOAL_DELAY_S, GOAL_TOLERANCE = 4, 0.05, 0.03
"""Issue 13's goal: 4 replicas synced at 50 ms within 3% of one router's p99 E2E and TTFT p99."""


@dataclass(frozen=True, slots=True)
class SweepWorkload:
    name: str
    rate_scale: float
    engines: int
    limit: int | None


DEFAULT_WORKLOADS = (
    SweepWorkload("rl-stragglers", 2.0, 4, 2),
    SweepWorkload("agentic-weka", 4.0, 4, 16),
    SweepWorkload("mooncake-conversation", 1.0, 8, 1500),
)
"""Loads near saturation (the rates and fleets of the ``fleet`` defaults' busiest runs)."""


@dataclass(frozen=True, slots=True)
class SweepSettings:
    workloads: tuple[SweepWorkload, ...] = DEFAULT_WORKLOADS
    routers: tuple[str, ...] = ("gie-default", "ray-kv-aware", "predicted-latency-token-load")
    router_replicas: tuple[int, ...] = (1, 2, 4, 8)
    sync_delays_s: tuple[float | None, ...] = (0.0, 0.05, 0.5, None)
    """None: the replicas never sync."""
    seed: int = 0
    profile: str = "llama-3.1-8b-h100"
    scrape_interval_s: float = 0.05
    retrain_interval_s: float = 10.0


def delay_label(delay_s: float | None) -> str:
    return "no sync" if delay_s is None else f"{delay_s * 1e3:g} ms"


def _cases(settings: SweepSettings) -> list[tuple[int, float | None]]:
    """(K, d) pairs to run; K = 1 once, as the single router (there is no peer to sync with)."""
    cases: list[tuple[int, float | None]] = [(1, None)] if 1 in settings.router_replicas else []
    cases += [(k, d) for k in settings.router_replicas if k > 1 for d in settings.sync_delays_s]
    return cases


def run(settings: SweepSettings, out_dir: Path) -> dict[str, Any]:
    profile = load_profile(settings.profile)
    cases = _cases(settings)
    runs: list[dict[str, Any]] = []
    workloads: dict[str, dict[str, Any]] = {}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns) as progress:
        for spec in settings.workloads:
            options = WorkloadOptions(
                scale=spec.rate_scale,
                seed=settings.seed,
                limit=spec.limit,
                max_model_len=profile.engine.max_model_len,
            )
            workload = build_workload(spec.name, options)
            workloads[spec.name] = {**asdict(spec), "description": workload.description}
            config = FleetConfig(
                replicas=spec.engines,
                profile=settings.profile,
                scrape_interval_s=settings.scrape_interval_s,
                retrain_interval_s=settings.retrain_interval_s,
                seed=settings.seed,
            )
            task = progress.add_task(spec.name, total=len(settings.routers) * len(cases))
            for router in settings.routers:
                for replicas, delay in cases:
                    progress.update(
                        task, description=f"{spec.name} {router} K={replicas} {delay_label(delay)}"
                    )
                    simulator = FleetSimulator(
                        workload,
                        lambda clock, router=router, k=replicas, d=delay: make_router(
                            router, clock, settings.seed, router_replicas=k, sync_delay_s=d
                        ),
                        config,
                    )
                    summary = summarize(simulator.run(), workload)
                    runs.append(
                        {
                            "workload": spec.name,
                            "router_replicas": replicas,
                            "sync_delay_ms": None if delay is None else delay * 1e3,
                            **summary,
                        }
                    )
                    progress.advance(task)
    data = {
        "benchmark": "sync-sweep",
        "settings": asdict(settings),
        "workloads": workloads,
        "profile": {"name": profile.name, "description": profile.description, "source": profile.source},
        "machine": machine(),
        "runs": runs,
        "goal": goal_verdicts(runs),
    }
    plot = _plot(out_dir, settings, runs)
    write_results(out_dir, "sync-sweep", data, _markdown(data, settings, plot))
    return data


def _change(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base - 1


def _baseline(runs: Sequence[dict[str, Any]], workload: str, router: str) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in runs
            if r["workload"] == workload and r["router"] == router and r["router_replicas"] == 1
        ),
        None,
    )


def goal_verdicts(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and router: 4 replicas synced at 50 ms against one router (p99 E2E, TTFT p99)."""
    verdicts = []
    for run in runs:
        if run["router_replicas"] != GOAL_REPLICAS or run["sync_delay_ms"] != GOAL_DELAY_S * 1e3:
            continue
        base = _baseline(runs, run["workload"], run["router"])
        if base is None:
            continue
        e2e = _change(run["e2e_ms"]["p99"], base["e2e_ms"]["p99"])
        ttft = _change(run["ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        verdicts.append(
            {
                "workload": run["workload"],
                "router": run["router"],
                "e2e_p99_change": e2e,
                "ttft_p99_change": ttft,
                "met": e2e is not None
                and ttft is not None
                and e2e <= GOAL_TOLERANCE
                and ttft <= GOAL_TOLERANCE,
            }
        )
    return verdicts


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.1f}%"


def table_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "router",
        "K",
        "sync",
        "E2E p99 s",
        "vs K=1",
        "TTFT p50/p99 ms",
        "TTFT p99 vs K=1",
        "load CV",
        "hit rate",
        "rej.",
    ]
    rows = []
    for run in runs:
        base = _baseline(runs, run["workload"], run["router"])
        e2e, ttft = run["e2e_ms"]["p99"], run["ttft_ms"]
        delay = run["sync_delay_ms"]
        rows.append(
            [
                run["router"],
                str(run["router_replicas"]),
                "–" if run["router_replicas"] == 1 else delay_label(None if delay is None else delay / 1e3),
                cell(None if e2e is None else e2e / 1e3, 2),
                "" if base is None or base is run else _pct(_change(e2e, base["e2e_ms"]["p99"])),
                f"{cell(ttft['p50'])}/{cell(ttft['p99'])}",
                "" if base is None or base is run else _pct(_change(ttft["p99"], base["ttft_ms"]["p99"])),
                cell(run["load_cv_mean"], 3),
                cell(run["prefix_cache_hit_rate"], 3),
                str(run["rejected"]),
            ]
        )
    return headers, rows


def _markdown(data: dict[str, Any], settings: SweepSettings, plot: str) -> str:
    profile = data["profile"]
    lines = [
        "# What replica sync is worth: K EPP replicas × sync delay",
        "",
        f"- Engine profile: **{profile['name']}**. {profile['description']}",
        f"- K EPP replicas take requests round-robin (as Envoy spreads ext_proc streams); each has its "
        "own pipeline state and applies its peers' deltas (token load, prefix-index inserts, running "
        "TPOT SLOs) through `epp.sync.state` after the sync delay; 'no sync': they never exchange "
        "any. All replicas read the same engine-metric scrapes "
        f"(every {settings.scrape_interval_s * 1e3:g} ms) and share one latency predictor "
        f"(retrained every {settings.retrain_interval_s:g} virtual s).",
        f"- Seed {settings.seed}. Machine: {data['machine']['cpus']} CPUs, Python "
        f"{data['machine']['python']}, {data['machine']['date']}.",
        "",
        f"## Goal: {GOAL_REPLICAS} replicas synced at {GOAL_DELAY_S * 1e3:g} ms within "
        f"{GOAL_TOLERANCE:.0%} of one router",
        "",
    ]
    verdicts = data["goal"]
    if verdicts:
        lines += [
            markdown_table(
                ["workload", "router", "E2E p99", "TTFT p99", "met"],
                [
                    [
                        v["workload"],
                        v["router"],
                        _pct(v["e2e_p99_change"]),
                        _pct(v["ttft_p99_change"]),
                        "yes" if v["met"] else "no",
                    ]
                    for v in verdicts
                ],
            ),
            "",
        ]
    else:
        lines += ["Not measured (the sweep ran no K = 4 at 50 ms, or no single router).", ""]
    for name, spec in data["workloads"].items():
        runs = [run for run in data["runs"] if run["workload"] == name]
        headers, rows = table_rows(runs)
        lines += [
            f"## {name} (rate scale {spec['rate_scale']:g}, {spec['engines']} engines)",
            "",
            f"{spec['description']}.",
            "",
            markdown_table(headers, rows),
            "",
            f"Simulated {runs[0]['virtual_s']:.0f} virtual s; "
            f"wall time {sum(r['wall_s'] for r in runs):.0f} s.",
            "",
        ]
    lines.append(f"![{plot}]({plot})")
    return "\n".join(lines)


def _plot(out_dir: Path, settings: SweepSettings, runs: Sequence[dict[str, Any]]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [spec.name for spec in settings.workloads]
    figure, axes = plt.subplots(
        len(names),
        len(settings.routers),
        figsize=(5 * len(settings.routers), 3.6 * len(names)),
        squeeze=False,
    )
    for row, workload in zip(axes, names, strict=True):
        for axis, router in zip(row, settings.routers, strict=True):
            mine = [r for r in runs if r["workload"] == workload and r["router"] == router]
            base = next((r for r in mine if r["router_replicas"] == 1), None)
            for delay in settings.sync_delays_s:
                delay_ms = None if delay is None else delay * 1e3
                points = [(1, base["e2e_ms"]["p99"])] if base is not None else []
                points += [
                    (r["router_replicas"], r["e2e_ms"]["p99"])
                    for r in mine
                    if r["router_replicas"] > 1 and r["sync_delay_ms"] == delay_ms
                ]
                points = [(k, v / 1e3) for k, v in points if v is not None]
                if points:
                    axis.plot(*zip(*points, strict=True), marker="o", label=delay_label(delay))
            axis.set_xscale("log", base=2)
            axis.set_xticks(list(settings.router_replicas), [str(k) for k in settings.router_replicas])
            axis.set_xlabel("EPP replicas K")
            axis.set_ylabel("E2E p99 (s)")
            axis.set_title(f"{workload}: {router}", fontsize=9)
            axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="sync delay")
    figure.suptitle("p99 E2E against the number of EPP replicas, by sync delay")
    figure.tight_layout()
    return save_figure(figure, out_dir, "sync-sweep.png")
