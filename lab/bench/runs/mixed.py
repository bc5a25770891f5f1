"""``llm-epp-bench mixed``: the policy lab's rows for mixed pools (issue 25 §6).

Every router and the oracle on each pool of :data:`POOLS`, at :data:`LOADS` (50, 70 and 90%) of
that pool's capacity, on one open-loop trace. Capacity is measured, not assumed: the highest rate
scale of the trace at which the pool, routed by :data:`REFERENCE_ROUTER`, keeps up (its backlog
stays bounded over the second half of the arrivals, the criterion of
``bench.runs.flow_control.measure_capacity``), found by bisection. One ``compare`` report per pool
(JSON, Markdown, PNG, in a folder named after the pool, its rate scales the measured loads), and
a summary over both: ``mixed.json``, ``mixed.md`` (per pool, load and router: TTFT and E2E p99,
the share of requests on the pool's slower replicas, the predictor's error) and ``mixed.png``.

The trace is open loop on purpose: the agentic trace's load is set by its number of closed-loop
sessions (each waits for its previous answer), and at the sizes that run here (16 sessions) it
stays far below either pool's capacity at any rate scale, so its "90% of capacity" does not
exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from bench.runs import compare
from bench.runs.flow_control import UNSTABLE_GROWTH, backlog_growth
from bench.workloads.fleet_workloads import pool_workload
from sim.engine.pool import pool_profiles, pool_size
from sim.fleet import FleetConfig, FleetSimulator, make_router, router_names
from sim.measure.report import cell, machine, markdown_table, save_figure, write_results

POOLS = {
    "2fast-2slow": "llama-3.1-8b-h100:2,llama-3.1-8b-h100+slowdown=2.5:2",
    "1large-3small": "llama-3.1-8b-h100:1,llama-3.1-8b-a100+num_gpu_blocks=8000+max_num_seqs=64:3",
}
"""Two H100s beside two engines 2.5 times slower; one H100 beside three A100s with a quarter of its
KV cache and 64 batch slots (L4-class memory). The first profile of each is its fast one."""

LOADS = (0.5, 0.7, 0.9)
REFERENCE_ROUTER = "gie-default"
CAPACITY_SEARCH_STEPS = 6


@dataclass(frozen=True)
class MixedSettings:
    workload: str = "mooncake-conversation-spread"
    limit: int = 600
    """First requests of the trace per run."""
    routers: tuple[str, ...] = field(default_factory=lambda: tuple(router_names()))
    loads: tuple[float, ...] = LOADS
    seed: int = 0
    max_rate_scale: float = 8.0
    """The capacity search's upper bound (rate scales)."""


def measure_capacity(settings: MixedSettings, pool: str) -> float:
    """The highest rate scale of the trace that ``pool`` keeps up with under the reference
    router, to 1/2^``CAPACITY_SEARCH_STEPS`` of ``max_rate_scale``."""
    replicas = pool_size(pool) or 1
    low, high = 0.0, settings.max_rate_scale
    profiles = pool_profiles(pool, replicas)
    config = FleetConfig(replicas=replicas, profile=pool, seed=settings.seed)
    for _ in range(CAPACITY_SEARCH_STEPS):
        scale = (low + high) / 2
        workload = pool_workload(settings.workload, profiles, scale, settings.seed, settings.limit)
        result = FleetSimulator(
            workload, lambda clock: make_router(REFERENCE_ROUTER, clock, settings.seed), config
        ).run()
        window = max(r.arrival for r in result.records)
        offered = len(result.records) / window
        if backlog_growth(result.records, window) > UNSTABLE_GROWTH * offered:
            high = scale
        else:
            low = scale
    return low


def slow_share(run: dict[str, Any]) -> float:
    """The share of completed requests on the replicas of every profile but the first (fast) one."""
    profiles = list(run["by_profile"].values())
    return sum(p["share"] or 0.0 for p in profiles[1:])


def run(settings: MixedSettings, out_dir: Path) -> dict[str, Any]:
    pools = []
    for label, pool in POOLS.items():
        capacity = measure_capacity(settings, pool)
        scales = tuple(round(load * capacity, 4) for load in settings.loads)
        report = compare.run(
            compare.CompareSettings(
                settings.workload,
                settings.routers,
                replicas=pool_size(pool) or 0,
                rate_scales=scales,
                seed=settings.seed,
                profile=pool,
                limit=settings.limit,
            ),
            out_dir / label,
        )
        rows = [
            {
                "load": load,
                "rate_scale": scale,
                "router": r["router"],
                "ttft_p99_ms": r["ttft_ms"]["p99"],
                "e2e_p99_s": None if r["e2e_ms"]["p99"] is None else r["e2e_ms"]["p99"] / 1e3,
                "slow_share": slow_share(r),
                "predictor_ttft_mape": r["predictor_ttft_mape"],
                "predictor_tpot_mape": r["predictor_tpot_mape"],
                "predicted_requests": r["predicted_requests"],
            }
            for load, scale in zip(settings.loads, scales, strict=True)
            for r in report["runs"]
            if r["rate_scale"] == scale
        ]
        pools.append({"label": label, "pool": pool, "capacity_rate_scale": capacity, "rows": rows})
    data = {
        "benchmark": "mixed",
        "settings": asdict(settings),
        "reference_router": REFERENCE_ROUTER,
        "machine": machine(),
        "pools": pools,
    }
    figure = _figure(pools, settings.loads)
    write_results(out_dir, "mixed", data, _markdown(data, [save_figure(figure, out_dir, "mixed.png")]))
    return data


def _markdown(data: dict[str, Any], plots: Sequence[str]) -> str:
    s = data["settings"]
    lines = [
        "# Mixed pools: every router at 50/70/90% of capacity",
        "",
        f"- Workload {s['workload']}, first {s['limit']} requests, seed {s['seed']}; "
        f"{data['machine']['date']}.",
        f"- Capacity: the highest rate scale the pool keeps up with under {data['reference_router']} "
        "(bisection on the backlog's growth).",
        "",
    ]
    headers = [
        "router",
        *(f"{h} @{load:g}" for load in s["loads"] for h in ("TTFT p99 ms", "E2E p99 s", "slow share")),
    ]
    for pool in data["pools"]:
        lines += [
            f"## {pool['label']}: `{pool['pool']}`",
            "",
            f"Capacity: rate scale {pool['capacity_rate_scale']:.3g}.",
            "",
        ]
        by_router: dict[str, list[str]] = {}
        for row in pool["rows"]:
            by_router.setdefault(row["router"], []).extend(
                [cell(row["ttft_p99_ms"]), cell(row["e2e_p99_s"], 2), cell(row["slow_share"], 3)]
            )
        lines += [markdown_table(headers, [[name, *cells] for name, cells in by_router.items()]), ""]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines)


def _figure(pools: list[dict[str, Any]], loads: Sequence[float]) -> Figure:
    figure, axes = plt.subplots(len(pools), 2, figsize=(14, 5 * len(pools)), squeeze=False)
    for row_axes, pool in zip(axes, pools, strict=True):
        routers = dict.fromkeys(r["router"] for r in pool["rows"])
        colours = plt.get_cmap("tab20").colors  # one per router: the default cycle has ten
        for router, colour in zip(routers, colours * 2, strict=False):
            rows = [r for r in pool["rows"] if r["router"] == router]
            style = (
                {"linewidth": 2.5}
                if router in ("oracle", "predicted-latency-token-load", "gie-default")
                else {}
            )
            row_axes[0].plot(
                loads, [r["ttft_p99_ms"] for r in rows], marker="o", label=router, color=colour, **style
            )
            row_axes[1].plot(
                loads, [r["e2e_p99_s"] for r in rows], marker="o", label=router, color=colour, **style
            )
        for axis, title in zip(row_axes, ("TTFT p99 (ms)", "E2E p99 (s)"), strict=True):
            axis.set_title(f"{pool['label']}: {title}")
            axis.set_xlabel("load (x capacity)")
            axis.set_yscale("log")
        row_axes[1].legend(fontsize=7, ncol=2)
    figure.tight_layout()
    return figure
