"""``llm-epp-bench prediction-floor``: how far a router's latency predictions are from what the
state at each decision determines.

One fleet-simulator run of one router. As each request is routed, ``sim.fleet.clairvoyant``
runs a copy of the chosen engine with no later arrival (it knows the engine's exact state and
the request's true output length): its TTFT and TPOT error against what happened is what later
arrivals make, a floor for any predictor of the present state. Beside it: that copy times the
one factor that best fits it (later arrivals' average effect), and the router's own predictions
on the requests it predicted. Writes ``prediction-floor.json``, ``.md`` and a PNG of the
actual/foreseen and actual/predicted ratios.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.harness.fleet_metrics import mape
from bench.workloads.fleet_workloads import pool_workload
from sim.engine import EngineRequest
from sim.engine.pool import pool_profiles
from sim.fleet import FleetConfig, FleetSimulator, make_router
from sim.fleet.clairvoyant import Foreseen, foresee
from sim.fleet.replica import Replica
from sim.fleet.simulator import SimulatedRequest
from sim.measure.report import cell, markdown_table, save_figure, write_results

NAME = "prediction-floor"
FACTORS = np.exp(np.linspace(-1.0, 1.5, 501))
"""The single factors tried on the copy's latencies (e^-1 to e^1.5)."""


@dataclass(frozen=True, slots=True)
class FloorSettings:
    workload: str = "mooncake-conversation-spread"
    profile: str = "llama-3.1-8b-h100:2,llama-3.1-8b-h100+slowdown=2.5:2"
    replicas: int = 4
    rate_scale: float = 2.1875
    """70% of that pool's capacity (``bench.runs.mixed``)."""
    limit: int = 600
    seed: int = 0
    router: str = "predicted-latency-token-load"


@dataclass(frozen=True, slots=True)
class Triple:
    """One request's latency (one target): what happened, what the copy saw, what the router
    predicted (None where it predicted nothing)."""

    actual: float
    foreseen: float
    predicted: float | None
    profile: str


def best_factor(triples: Sequence[Triple]) -> tuple[float, float] | None:
    """The factor on the copy's latencies with the least MAPE, and that MAPE."""
    if not triples:
        return None
    actual = np.array([t.actual for t in triples])
    foreseen = np.array([t.foreseen for t in triples])
    errors = [float(np.mean(np.abs(f * foreseen - actual) / actual)) for f in FACTORS]
    best = int(np.argmin(errors))
    return float(FACTORS[best]), errors[best]


def summarize(triples: Sequence[Triple]) -> dict[str, Any]:
    """The copy's error, its best single factor's, and the router's on what it predicted."""
    predicted = [t for t in triples if t.predicted is not None]
    ratios = [t.actual / t.foreseen for t in triples]
    factor = best_factor(triples)
    by_profile = {
        profile: {
            "foreseen_mape": mape([(t.foreseen, t.actual) for t in predicted if t.profile == profile]),
            "predicted_mape": mape([(t.predicted, t.actual) for t in predicted if t.profile == profile]),  # type: ignore[misc]
        }
        for profile in sorted({t.profile for t in triples})
    }
    return {
        "requests": len(triples),
        "foreseen_mape": mape([(t.foreseen, t.actual) for t in triples]),
        "best_factor": None if factor is None else factor[0],
        "best_factor_mape": None if factor is None else factor[1],
        "actual_over_foreseen_p50_p90_p99": (
            [float(v) for v in np.percentile(ratios, [50, 90, 99])] if ratios else None
        ),
        "predicted_requests": len(predicted),
        "predicted_mape": mape([(t.predicted, t.actual) for t in predicted]),  # type: ignore[misc]
        "foreseen_mape_on_predicted": mape([(t.foreseen, t.actual) for t in predicted]),
        "by_profile": by_profile,
    }


def run(settings: FloorSettings, out_dir: Path) -> dict[str, Any]:
    profiles = pool_profiles(settings.profile, settings.replicas)
    workload = pool_workload(settings.workload, profiles, settings.rate_scale, settings.seed, settings.limit)
    foreseen: dict[str, tuple[float, Foreseen | None]] = {}

    def on_routed(record: SimulatedRequest, replica: Replica, request: EngineRequest, delay_s: float) -> None:
        assert request.arrival_time is not None
        foreseen[record.request_id] = request.arrival_time, foresee(replica, request, delay_s)

    config = FleetConfig(replicas=settings.replicas, profile=settings.profile, seed=settings.seed)
    simulator = FleetSimulator(
        workload, lambda clock: make_router(settings.router, clock, settings.seed), config, on_routed
    )
    result = simulator.run()
    ttft: list[Triple] = []
    tpot: list[Triple] = []
    for record in result.records:
        routed_at, seen = foreseen.get(record.request_id, (0.0, None))
        if seen is None or record.first_token is None:
            continue
        profile = result.replica_profiles[record.replica]
        ttft_ms, tpot_ms = record.predicted_ttft_ms, record.predicted_tpot_ms
        # From the decision, as the copy counts it (a request held by flow control waited before).
        actual_ttft = record.first_token - routed_at
        ttft.append(Triple(actual_ttft, seen.ttft_s, None if ttft_ms is None else ttft_ms / 1e3, profile))
        if record.tpot is not None and seen.tpot_s:
            tpot.append(Triple(record.tpot, seen.tpot_s, None if tpot_ms is None else tpot_ms / 1e3, profile))
    data = {
        "settings": asdict(settings),
        "workload": workload.description,
        "ttft": summarize(ttft),
        "tpot": summarize(tpot),
    }
    data["figure"] = _figure(ttft, tpot, out_dir)
    write_results(out_dir, NAME, data, _markdown(data))
    return data


def _markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = []
    for target in ("ttft", "tpot"):
        t = data[target]
        rows.append(
            [
                target.upper(),
                t["requests"],
                cell(t["foreseen_mape"], 3),
                f"{cell(t['best_factor_mape'], 3)} (x{cell(t['best_factor'], 2)})",
                f"{t['predicted_requests']}",
                cell(t["predicted_mape"], 3),
                cell(t["foreseen_mape_on_predicted"], 3),
            ]
        )
    headers = [
        "target",
        "requests",
        "copy's MAPE",
        "copy x best factor",
        "predicted",
        "router's MAPE",
        "copy's MAPE on those",
    ]
    profile_rows = [
        [profile, cell(v["foreseen_mape"], 3), cell(v["predicted_mape"], 3)]
        for profile, v in data["ttft"]["by_profile"].items()
    ]
    return "\n\n".join(
        [
            f"# Prediction floor: {s['router']} on {s['workload']} x{s['rate_scale']:g}, {s['profile']} "
            f"({s['limit']} requests, seed {s['seed']})",
            markdown_table(headers, rows),
            "TTFT on the predicted requests, by profile:",
            markdown_table(["profile", "copy's MAPE", "router's MAPE"], profile_rows),
            f"![ratios]({data['figure']})",
        ]
    )


def _figure(ttft: Sequence[Triple], tpot: Sequence[Triple], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, name, triples in zip(axes, ("TTFT", "TPOT"), (ttft, tpot), strict=True):
        for label, values in (
            ("actual / copy", [t.actual / t.foreseen for t in triples]),
            ("actual / predicted", [t.actual / t.predicted for t in triples if t.predicted]),
        ):
            if values:
                ordered = np.sort(values)
                axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
        axis.set_xscale("log")
        axis.set_xlabel(f"{name}: actual over estimate")
        axis.set_ylabel("fraction of requests")
        axis.axvline(1.0, color="grey", lw=0.8)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return save_figure(figure, out_dir, f"{NAME}.png")
