"""``llm-epp-bench compare``: replay one workload through several routers on the fleet simulator.

Every router sees the same workload (same seed, same arrivals, same tokens) on the same engine
profile; the load is swept by the rate scales (``--rate-scales 0.5,1,2,4`` goes past
saturation). Writes ``compare-<workload>.json`` (every metric of ``bench.harness.fleet_metrics`` per scale
and router, plus the run's settings), ``compare-<workload>.md`` (tables) and PNGs: latency CDFs
per router, load CV over time, prefix-cache hit rate against concurrency. ``--estimated-tokens``
adds each router's runs on token counts estimated from the text (docs/tokenizer.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.harness.fleet_metrics import load_cv_series, summarize
from bench.workloads.fleet_workloads import pool_workload
from sim.engine.pool import describe_pool, pool_profiles
from sim.fleet import FleetConfig, FleetResult, FleetSimulator, make_router, router_names
from sim.measure.report import cell, machine, markdown_table, save_figure, style_latency_cdfs, write_results


@dataclass(frozen=True, slots=True)
class CompareSettings:
    workload: str
    routers: tuple[str, ...]
    replicas: int = 8
    rate_scales: tuple[float, ...] = (1.0,)
    seed: int = 0
    profile: str = "llama-3.1-8b-h100"
    limit: int | None = None
    scrape_interval_s: float = 0.05
    retrain_interval_s: float = 10.0
    estimated_tokens: tuple[float, ...] = ()
    """Also run every router on token counts estimated from the text (an EPP without the model's
    tokenizer), once per bytes-a-token of the text given here; labelled ``ROUTER~estB``."""
    calibrated_estimates: bool = False
    """Also run each of those with the estimate at the text's bytes a token (an EPP sampling the
    model's tokenizer, ``--tokenize-every``); labelled ``ROUTER~calB``."""
    joins_at_s: tuple[float, ...] = ()
    """When the last replicas join the pool (``FleetConfig.joins_at_s``)."""
    output_hint_sigma: float | None = None
    """Clients send ``x-expected-output-tokens`` (``FleetConfig.output_hint_sigma``)."""


def variants(settings: CompareSettings) -> list[tuple[str, str, float | None, bool]]:
    """(label, router, estimated bytes a token or None for exact counts, whether the estimate is
    calibrated) of every run per scale."""
    estimates = [(est, False) for est in settings.estimated_tokens]
    if settings.calibrated_estimates:
        estimates += [(est, True) for est in settings.estimated_tokens]
    return [
        (router if est is None else f"{router}~{'cal' if cal else 'est'}{est:g}", router, est, cal)
        for router in settings.routers
        for est, cal in [(None, False), *estimates]
    ]


def resolve_routers(spec: str) -> tuple[str, ...]:
    """``all`` or a comma-separated list of router names."""
    if spec == "all":
        return tuple(router_names())
    return tuple(name.strip() for name in spec.split(",") if name.strip())


def run(settings: CompareSettings, out_dir: Path) -> dict[str, Any]:
    profiles = pool_profiles(settings.profile, settings.replicas)
    config = FleetConfig(
        replicas=settings.replicas,
        profile=settings.profile,
        scrape_interval_s=settings.scrape_interval_s,
        retrain_interval_s=settings.retrain_interval_s,
        seed=settings.seed,
        joins_at_s=settings.joins_at_s,
        output_hint_sigma=settings.output_hint_sigma,
    )
    runs: list[dict[str, Any]] = []
    described: dict[str, str] = {}
    parameters: dict[str, dict[str, Any]] = {}
    kept: dict[tuple[float, str], FleetResult] = {}
    workload = None
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*columns) as progress:
        for scale in settings.rate_scales:
            workload = pool_workload(settings.workload, profiles, scale, settings.seed, settings.limit)
            described[f"{scale:g}"] = workload.description
            parameters[f"{scale:g}"] = workload.params
            for label, router, estimated, calibrated in variants(settings):
                task = progress.add_task(f"{workload.name} x{scale:g} {label}", total=workload.num_requests)
                simulator = FleetSimulator(
                    workload,
                    lambda clock, router=router: make_router(router, clock, settings.seed),
                    replace(config, estimated_bytes_per_token=estimated, estimate_calibrated=calibrated),
                )
                result = simulator.run(lambda task=task: progress.advance(task))
                summary = summarize(result, workload)
                runs.append({"rate_scale": scale, **summary, "router": label})
                kept[(scale, label)] = result
                progress.update(
                    task, description=f"{workload.name} x{scale:g} {label} ({result.wall_s:.1f} s)"
                )
    assert workload is not None
    data = {
        "benchmark": "compare",
        "settings": asdict(settings),
        "workload": {
            "name": workload.name,
            "description_by_rate_scale": described,
            "params_by_rate_scale": parameters,
        },
        "slo": {"ttft_ms": workload.slo_ttft_ms, "tpot_ms": workload.slo_tpot_ms},
        "profile": describe_pool(profiles)[0],
        "pool": describe_pool(profiles),
        "machine": machine(),
        "runs": runs,
    }
    stem = "compare-" + re.sub(r"[^A-Za-z0-9._-]+", "_", workload.name.split(":")[0])
    plots = _plots(out_dir, stem, settings, [label for label, *_ in variants(settings)], kept, runs)
    write_results(out_dir, stem, data, _markdown(data, settings, plots))
    return data


def table_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "router",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90/p99 ms",
        "E2E p50/p90/p99 s",
        "session p99 s",
        "step p50/p99 s",
        "out tok/s",
        "goodput req/s",
        "SLO att.",
        "rej.",
        "hit rate",
        "load CV",
        "MAPE ttft/tpot",
        "decision µs",
    ]
    rows = []
    for run in runs:
        ttft, tpot, e2e = run["ttft_ms"], run["tpot_ms"], run["e2e_ms"]
        group = run["group_e2e_s"]
        mape = (
            f"{cell(run['predictor_ttft_mape'], 3)}/{cell(run['predictor_tpot_mape'], 3)}"
            if run["predicted_requests"]
            else "–"
        )
        rows.append(
            [
                run["router"],
                "/".join(cell(ttft[p]) for p in ("p50", "p90", "p99")),
                "/".join(cell(tpot[p], 1) for p in ("p50", "p90", "p99")),
                "/".join(cell(None if e2e[p] is None else e2e[p] / 1e3, 2) for p in ("p50", "p90", "p99")),
                cell(run["session_e2e_s"]["p99"], 1),
                f"{cell(group['p50'], 1)}/{cell(group['p99'], 1)}" if group else "–",
                cell(run["throughput_output_tok_s"]),
                cell(run["goodput_req_s"], 2),
                cell(run["slo_attainment"], 3),
                str(run["rejected"]),
                cell(run["prefix_cache_hit_rate"], 3),
                cell(run["load_cv_mean"], 3),
                mape,
                cell(run["decision_us"]["mean"]),
            ]
        )
    return headers, rows


def _markdown(data: dict[str, Any], settings: CompareSettings, plots: list[str]) -> str:
    workload, slo = data["workload"], data["slo"]
    lines = [f"# Router comparison: {workload['name']}", ""]
    for profile in data["pool"]:
        lines += [
            f"- Engine profile: **{profile['name']}** ({profile['replicas']} replicas). "
            f"{profile['description']}",
            f"- Profile source: {profile['source']}",
        ]
    lines += [
        f"- Seed {settings.seed} (workload, router RNGs, predictor training); rate scales "
        f"{', '.join(f'{s:g}' for s in settings.rate_scales)}; metrics scraped every "
        f"{settings.scrape_interval_s * 1e3:g} ms; predictor retrained every {settings.retrain_interval_s:g} "
        "virtual seconds.",
        f"- SLO: TTFT ≤ {cell(slo['ttft_ms'])} ms, TPOT ≤ {cell(slo['tpot_ms'])} ms "
        "(goodput and attainment).",
        f"- Machine: {data['machine']['cpus']} CPUs, Python {data['machine']['python']}, "
        f"{data['machine']['date']}.",
        "",
    ]
    for scale in settings.rate_scales:
        runs = [run for run in data["runs"] if run["rate_scale"] == scale]
        headers, rows = table_rows(runs)
        description = workload["description_by_rate_scale"][f"{scale:g}"]
        lines += [f"## Rate scale {scale:g}", "", f"{description}.", "", markdown_table(headers, rows), ""]
        walls = ", ".join(f"{run['router']} {run['wall_s']:.1f} s" for run in runs)
        lines += [f"Simulated {runs[0]['virtual_s']:.0f} virtual s; wall time per router: {walls}.", ""]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines)


def _plots(
    out_dir: Path,
    stem: str,
    settings: CompareSettings,
    labels: list[str],
    results: dict[tuple[float, str], FleetResult],
    runs: list[dict[str, Any]],
) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for scale in settings.rate_scales:
        figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for router in labels:
            records = [r for r in results[(scale, router)].records if r.completed]
            for axis, values in zip(
                axes,
                (
                    [r.ttft for r in records],
                    [r.tpot for r in records if r.tpot is not None],
                    [r.e2e for r in records],
                ),
                strict=True,
            ):
                if values:
                    ordered = np.sort(values)
                    axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=router)
        style_latency_cdfs(axes)
        figure.suptitle(f"Latency CDFs, rate scale {scale:g}")
        names.append(save_figure(figure, out_dir, f"{stem}-cdf-x{scale:g}.png"))

    scale = settings.rate_scales[-1]
    figure, axis = plt.subplots(figsize=(10, 4))
    for router in labels:
        result = results[(scale, router)]
        series = load_cv_series(result)
        axis.plot(result.sample_times, [np.nan if v is None else v for v in series], label=router, lw=0.8)
    axis.set_xlabel("virtual time (s)")
    axis.set_ylabel("CV of active decode KV blocks")
    axis.set_title(f"Load imbalance across replicas (0.5 s samples), rate scale {scale:g}")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    names.append(save_figure(figure, out_dir, f"{stem}-load-cv.png"))

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for router in labels:
        points = sorted(
            (run["mean_in_flight"], run["prefix_cache_hit_rate"])
            for run in runs
            if run["router"] == router and run["prefix_cache_hit_rate"] is not None
        )
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=router)
    axis.set_xlabel("mean requests in flight (concurrency)")
    axis.set_ylabel("prefix-cache hit rate (engine counters)")
    axis.set_title("Hit rate against concurrency (one point per rate scale)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    names.append(save_figure(figure, out_dir, f"{stem}-hit-rate.png"))
    return names
