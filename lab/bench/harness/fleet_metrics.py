"""Per-router metrics of a fleet run, from its request records and engine counters.

* TTFT, TPOT, E2E at p50/p90/p99 (completed requests; ms).
* Sessions: each session's span (first arrival to last finish), p50/p99; groups (RL steps) the
  same, when the workload has groups.
* Throughput: output tokens/s and requests/s over the makespan (first arrival to last finish).
* SLO: a request meets it when it completed with TTFT and TPOT within the workload's objectives;
  attainment = share of all requests (rejected ones included) that met it; goodput = those per
  second of makespan.
* Prefix-cache hit rate: the engines' own counters, token-weighted (hits / queries).
* Load CV: every ``sample_interval_s`` (0.5 s), the coefficient of variation (std / mean) of the
  KV blocks held by decoding requests across replicas; the mean over samples where any was held.
* Predictor MAPE: |predicted − actual| / actual of TTFT and TPOT on the chosen endpoint, over
  requests the router predicted for.
* Decision time: wall-clock time of each routing decision (µs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.fleet.simulator import FleetResult, SimulatedRequest
from sim.fleet.workload import Workload

PERCENTILES = (50, 90, 99)


def _percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    array = np.asarray(values, dtype=np.float64) * scale
    return {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}


def meets_slo(record: SimulatedRequest, workload: Workload) -> bool:
    if not record.completed:
        return False
    ttft, tpot = record.ttft, record.tpot
    if workload.slo_ttft_ms is not None and ttft is not None and ttft * 1e3 > workload.slo_ttft_ms:
        return False
    return not (workload.slo_tpot_ms is not None and tpot is not None and tpot * 1e3 > workload.slo_tpot_ms)


def load_cv_series(result: FleetResult) -> list[float | None]:
    """Per sample: CV of active decode KV blocks across replicas (None when none were held)."""
    series: list[float | None] = []
    for blocks in result.active_decode_blocks:
        array = np.asarray(blocks, dtype=np.float64)
        mean = array.mean() if len(array) else 0.0
        series.append(float(array.std() / mean) if mean > 0 else None)
    return series


def _spans(records: Sequence[SimulatedRequest], key: str) -> list[float]:
    spans: dict[str, list[float]] = {}
    for record in records:
        name = getattr(record, key)
        if not name or record.finish is None:
            continue
        span = spans.setdefault(name, [record.arrival, record.finish])
        span[0] = min(span[0], record.arrival)
        span[1] = max(span[1], record.finish)
    return [end - start for start, end in spans.values()]


def mape(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Mean of |predicted - actual| / actual over (predicted, actual) pairs with an actual above 0."""
    pairs = [(predicted, actual) for predicted, actual in pairs if actual > 0]
    if not pairs:
        return None
    return float(np.mean([abs(predicted - actual) / actual for predicted, actual in pairs]))


def _by_profile(result: FleetResult, done: Sequence[SimulatedRequest]) -> dict[str, dict[str, Any]]:
    """Per replica profile: its share of the completed requests, its TTFT, and the prediction
    error on it, overall and over its first 200 predicted requests and the rest (whether a mixed
    pool's slow replicas got a fair share, and how soon they were learned)."""
    groups: dict[str, list[SimulatedRequest]] = {name: [] for name in result.replica_profiles}
    for record in done:
        groups[result.replica_profiles[record.replica]].append(record)
    summary = {}
    for name, records in groups.items():
        predicted = [r for r in sorted(records, key=lambda r: r.arrival) if r.predicted_ttft_ms is not None]
        pairs = [(r.predicted_ttft_ms / 1e3, r.ttft) for r in predicted]  # type: ignore[operator, misc]
        summary[name] = {
            "replicas": result.replica_profiles.count(name),
            "share": len(records) / len(done) if done else None,
            "ttft_ms": _percentiles([r.ttft for r in records if r.ttft is not None], 1e3),
            "predictor_ttft_mape": mape(pairs),
            "predictor_ttft_mape_first_200": mape(pairs[:200]),
            "predictor_ttft_mape_after_200": mape(pairs[200:]),
        }
    return summary


def summarize(result: FleetResult, workload: Workload) -> dict[str, Any]:
    records = result.records
    done = [r for r in records if r.completed]
    rejected = [r for r in records if r.rejected is not None]
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.finish for r in records if r.finish is not None), default=start)
    makespan = max(end - start, 1e-9)
    good = sum(meets_slo(r, workload) for r in records)
    cv = [value for value in load_cv_series(result) if value is not None]
    decisions = [r.decision_s for r in records if r.replica >= 0]
    predicted = [r for r in done if r.predicted_ttft_ms is not None]
    reasons: dict[str, int] = {}
    for record in rejected:
        reasons[record.rejected or ""] = reasons.get(record.rejected or "", 0) + 1
    groups = _spans(records, "group")
    return {
        "router": result.router,
        "requests": len(records),
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_by_reason": reasons,
        "ttft_ms": _percentiles([r.ttft for r in done if r.ttft is not None], 1e3),
        "tpot_ms": _percentiles([r.tpot for r in done if r.tpot is not None], 1e3),
        "e2e_ms": _percentiles([r.e2e for r in done if r.e2e is not None], 1e3),
        "session_e2e_s": _percentiles(_spans(records, "session_id")),
        "group_e2e_s": _percentiles(groups) if groups else None,
        "throughput_output_tok_s": sum(r.output_tokens for r in done) / makespan,
        "throughput_req_s": len(done) / makespan,
        "goodput_req_s": good / makespan,
        "slo_attainment": good / len(records) if records else None,
        "prefix_cache_hit_rate": (
            result.prefix_cache_hits / result.prefix_cache_queries if result.prefix_cache_queries else None
        ),
        "preemptions": result.preemptions,
        "load_cv_mean": float(np.mean(cv)) if cv else None,
        "mean_in_flight": float(np.mean(result.in_flight)) if result.in_flight else 0.0,
        "predictor_ttft_mape": mape([(r.predicted_ttft_ms / 1e3, r.ttft) for r in predicted]),  # type: ignore[operator, misc]
        "predictor_tpot_mape": mape(
            [(r.predicted_tpot_ms / 1e3, r.tpot) for r in predicted if r.tpot is not None]  # type: ignore[operator]
        ),
        "predicted_requests": len(predicted),
        "by_profile": _by_profile(result, done),
        "retrains": result.retrains,
        "decision_us": {
            "mean": float(np.mean(decisions)) * 1e6 if decisions else None,
            **_percentiles(decisions, 1e6),
        },
        "virtual_s": result.virtual_s,
        "wall_s": result.wall_s,
    }
