"""``llm-epp-bench flow-control``: a two-tenant overload on the fleet simulator, with and without
flow control, and with each fairness policy (issue 14 §2).

The workload, at ``load`` × the pool's measured capacity in requests per second:

* tenant ``A``: 80% of the interactive requests, long agentic sessions (a prompt of a few
  thousand tokens that grows by each turn's output and a tool result, short think times);
* tenant ``B``: 20%, short chats with a TTFT objective (``SLO_TTFT_MS``);
* ``batch``: sheddable one-shot requests at priority −1, ``BATCH_SHARE`` of the interactive rate
  on top.

Sessions start open loop (Poisson); a session's turns follow each other closed loop. Capacity is
measured, not assumed: the highest offered rate of the mix at which the pool's backlog, without
flow control, stays bounded (:func:`measure_capacity`). Each run reports, per tenant: TTFT
p50/p99, SLO attainment (B: completed with TTFT within the objective; A and batch have none, so:
completed), goodput (those per second of the run's busy span, :func:`busy_span`),
shed count (429s) and flow-control queue time p50/p99. With ``epp_replicas`` K > 1, the
``replica_variant`` also runs on K synced EPP replicas, each with its own flow control, its
token-load detector counting its own bookings only or the pool's (issue 14 §3). Writes ``flow-control.json``,
``flow-control.md`` (the tenant × policy table, and the issue's goals) and ``flow-control.png``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from sim.engine.profile import load_profile
from sim.fleet import FleetConfig, FleetSimulator, Session, SimulatedRequest, Turn, Workload
from sim.fleet.flow_gate import flow_controlled_replicas, flow_controlled_router
from sim.measure.report import cell, machine, markdown_table, save_figure, write_results

SLO_TTFT_MS = 500.0
BATCH_SHARE = 0.25
A_SHARE = 0.8
CAPACITY_SEARCH_MAX = 3.0
CAPACITY_SEARCH_STEPS = 7
UNSTABLE_GROWTH = 0.07
TENANTS = ("A", "B", "batch")
BASE_PLUGINS = """
plugins:
- type: token-load-producer
- type: approximate-prefix-cache-producer
  parameters: {blockSizeTokens: 64, maxPrefixBlocksToMatch: 2048, lruCapacityPerServer: %(lru)s}
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: %(tokens)d%(prefill)s}
- type: queue-kv-saturation-detector
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: max-score-picker}
"""
FLOW_CONTROL = """
flowControl:
  saturationDetectors: [token-load-saturation-detector, queue-kv-saturation-detector]
  fairnessPolicy: %(fairness)s
  orderingPolicy: %(ordering)s
  defaultOutputTokens: 400
  defaultBand: {maxRequests: 2000, ttlSeconds: 4}
  bands:
  - {priority: -1, maxRequests: 500, ttlSeconds: 8}
"""
VARIANTS: dict[str, tuple[str, str, str | None] | None] = {
    "no flow control": None,
    "round-robin": ("round-robin-fairness", "fcfs-ordering", None),
    "least-attained-service": ("least-attained-service-fairness", "fcfs-ordering", None),
    "las + earliest deadline": ("least-attained-service-fairness", "earliest-deadline-ordering", None),
    "las + prefill limit": ("least-attained-service-fairness", "fcfs-ordering", "limit"),
    "las + prefill isolation": ("least-attained-service-fairness", "fcfs-ordering", "isolation"),
}
"""Fairness, ordering, and the token-load detector's prefill rule: None; ``limit``: each
endpoint's prompt tokens waiting for their first token at most one engine step's token budget
(dispatched per endpoint); ``isolation``: that, and prefill isolation
(``OverloadSettings.isolated_prefill_tokens``, ``isolation_prefix_lru_blocks``)."""


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    loads: tuple[float, ...] = (0.5, 1.5, 2.0)
    variants: tuple[str, ...] = tuple(VARIANTS)
    duration_s: float = 40.0
    replicas: int = 2
    profile: str = "llama-3.1-8b-h100"
    max_tokens_per_endpoint: int | None = None
    """The token-load detector's room per replica (booked prompt + expected output tokens);
    None: the profile's KV cache, in tokens (booked beyond it, the engine must preempt)."""
    first_guess_rps: float = 40.0
    epp_replicas: int = 1
    """Above 1: also run ``replica_variant`` at each load above 1× with this many EPP replicas,
    counting per-replica and pool-wide token load (issue 14 §3)."""
    replica_variant: str = "las + prefill limit"
    sync_delay_s: float = 0.005
    """Between the EPP replicas (their NATS hop)."""
    isolated_prefill_tokens: int = 4096
    """The ``isolation`` variants' ``isolatedPrefillTokens``: the prefill an endpoint kept for
    requests with a TTFT objective may have in flight (half a step's token budget)."""
    capacity_rps: float | None = None
    """The pool's capacity, when known from an earlier run (None: measured)."""
    isolation_prefix_lru_blocks: int | None = 4000
    """The ``isolation`` variants' approximate prefix index ``lruCapacityPerServer`` (None:
    ``auto``, the whole KV cache, as the other variants have). Under overload running requests
    hold about half the KV cache, so the engine keeps about half of it as prefix cache; an index
    that remembers more takes evicted prompts for cached, and prefill isolation books them as a
    few tokens where the engine computes thousands."""
    seed: int = 0


def _agentic(rng: random.Random, sid: str, start: float) -> Session:
    turns = [Turn(rng.randint(2000, 4000), rng.randint(100, 300))]
    for _ in range(rng.randint(4, 10)):
        grown = turns[-1].input_tokens + turns[-1].output_tokens + rng.randint(200, 800)
        turns.append(Turn(grown, rng.randint(100, 300), prefix="previous", think_s=rng.uniform(0.2, 1.0)))
    return Session(sid, start, tuple(turns), tenant="A")


def _chat(rng: random.Random, sid: str, start: float) -> Session:
    turns = [Turn(rng.randint(100, 400), rng.randint(30, 120))]
    for _ in range(rng.randint(0, 2)):
        grown = turns[-1].input_tokens + turns[-1].output_tokens + rng.randint(20, 100)
        turns.append(Turn(grown, rng.randint(30, 120), prefix="previous", think_s=rng.uniform(2.0, 5.0)))
    return Session(sid, start, tuple(turns), tenant="B", slo_ttft_ms=SLO_TTFT_MS)


def _batch(rng: random.Random, sid: str, start: float) -> Session:
    return Session(
        sid, start, (Turn(rng.randint(1000, 2000), rng.randint(200, 400)),), tenant="batch", priority=-1
    )


MEAN_TURNS = {"A": 1 + 7, "B": 1 + 1, "batch": 1}
BUILDERS = {"A": _agentic, "B": _chat, "batch": _batch}


def overload_workload(rate_rps: float, duration_s: float, seed: int) -> Workload:
    """The mix at ``rate_rps`` interactive requests per second (batch on top), arrivals over
    ``duration_s``."""
    rng = random.Random(seed)
    request_rates = {"A": A_SHARE * rate_rps, "B": (1 - A_SHARE) * rate_rps, "batch": BATCH_SHARE * rate_rps}
    sessions: list[Session] = []
    for tenant, rate in request_rates.items():
        session_rate = rate / MEAN_TURNS[tenant]
        t = rng.expovariate(session_rate)
        n = 0
        while t < duration_s:
            sessions.append(BUILDERS[tenant](rng, f"{tenant}-{n}", t))
            n += 1
            t += rng.expovariate(session_rate)
    sessions.sort(key=lambda s: s.start_s)
    return Workload(
        "two-tenant-overload",
        sessions,
        description="tenant A agentic sessions (80%), tenant B chats with a TTFT SLO (20%), sheddable batch",
        params={"rate_rps": rate_rps, "duration_s": duration_s, "seed": seed},
    )


def detector_limits(settings: OverloadSettings) -> tuple[int, int]:
    """The token-load detector's limits per endpoint, from the engine profile: booked tokens up to
    the KV cache's size (unless set), prompt tokens awaiting their first token up to one step's
    token budget."""
    engine = load_profile(settings.profile).engine
    kv_tokens = (engine.num_gpu_blocks - 1) * engine.block_size
    return settings.max_tokens_per_endpoint or kv_tokens, engine.max_num_batched_tokens


def config_yaml(variant: str, settings: OverloadSettings) -> str:
    tokens, step_tokens = detector_limits(settings)
    policies = VARIANTS[variant]
    rule = None if policies is None else policies[2]
    prefill = "" if rule is None else f", maxPrefillTokensPerEndpoint: {step_tokens}"
    if rule == "isolation":
        prefill += f", isolatedPrefillTokens: {settings.isolated_prefill_tokens}"
    text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
    lru = settings.isolation_prefix_lru_blocks if rule == "isolation" else None
    lru = "auto" if lru is None else lru
    text += BASE_PLUGINS % {"tokens": tokens, "prefill": prefill, "lru": lru}
    if policies is not None:
        text += FLOW_CONTROL % {"fairness": policies[0], "ordering": policies[1]}
    return text


EPP_REPLICA_MODES = ("per-replica tokens", "pool-wide tokens")
"""With K EPP replicas: each token-load detector counts its own bookings, or also its peers'."""


def _simulate(
    variant: str, workload: Workload, settings: OverloadSettings, config_dir: Path, mode: str | None = None
):
    """One run; ``mode`` (one of ``EPP_REPLICA_MODES``): ``settings.epp_replicas`` synced EPP
    replicas, each with its own flow control."""
    path = config_dir / f"{variant.replace(' ', '-').replace('+', 'and')}.yaml"
    path.write_text(config_yaml(variant, settings))

    def router(clock):
        if mode is None:
            return flow_controlled_router(str(path), clock, settings.seed, name=variant)
        return flow_controlled_replicas(
            str(path),
            clock,
            settings.seed,
            replicas=settings.epp_replicas,
            sync_delay_s=settings.sync_delay_s,
            pool_wide=mode == "pool-wide tokens",
            name=variant,
        )

    simulator = FleetSimulator(
        workload,
        router,
        FleetConfig(replicas=settings.replicas, profile=settings.profile, seed=settings.seed),
    )
    result = simulator.run()
    gate = simulator.router.flow_gate
    return result, (gate.queue_time_s if gate is not None else {})


def _pct(values: Sequence[float], p: float, scale: float = 1e3) -> float | None:
    return float(np.percentile(np.asarray(values) * scale, p)) if values else None


def tenant_metrics(
    records: Sequence[SimulatedRequest], tenants: dict[str, str], queue_s: dict[str, float], span_s: float
) -> dict[str, dict[str, Any]]:
    """Per tenant: TTFT p50/p99 (ms), SLO attainment, goodput (req/s), shed, queue time p50/p99 (ms)."""
    out = {}
    for tenant in TENANTS:
        mine = [r for r in records if tenants[r.session_id] == tenant]
        done = [r for r in mine if r.completed and r.ttft is not None]
        slo = SLO_TTFT_MS / 1e3 if tenant == "B" else None
        good = [r for r in done if slo is None or r.ttft <= slo]  # type: ignore[operator]
        queued = [queue_s.get(r.request_id, 0.0) for r in mine if r.replica >= 0]
        out[tenant] = {
            "requests": len(mine),
            "ttft_p50_ms": _pct([r.ttft for r in done], 50),  # type: ignore[misc]
            "ttft_p99_ms": _pct([r.ttft for r in done], 99),  # type: ignore[misc]
            "slo_attainment": len(good) / len(mine) if mine else None,
            "goodput_req_s": len(good) / span_s,
            "goodput_tok_s": sum(r.output_tokens for r in good) / span_s,
            "shed": sum(r.rejected is not None for r in mine),
            "queue_p50_ms": _pct(queued, 50),
            "queue_p99_ms": _pct(queued, 99),
        }
    return out


def backlog_growth(records: Sequence[SimulatedRequest], duration_s: float) -> float:
    """How fast interactive requests pile up in the pool (arrived, not finished), in requests per
    second, over the second half of the arrival window (the first half is the sessions' ramp-up).
    Near zero while the pool keeps up; the arrival rate less the service rate once it does not."""
    interactive = [r for r in records if not r.session_id.startswith("batch")]

    def in_system(t: float) -> int:
        return sum(1 for r in interactive if r.arrival <= t and (r.finish is None or r.finish > t))

    half = duration_s / 2
    return (in_system(duration_s) - in_system(half)) / half


def measure_capacity(settings: OverloadSettings, config_dir: Path) -> float:
    """The highest interactive rate (requests per second, batch on top) the pool sustains without
    flow control: bisection on the offered rate for the point where the backlog starts to grow
    without bound (grows by more than ``UNSTABLE_GROWTH`` of the offered rate). The completion
    rate under a far higher offered load is no measure: the engines' queues then hold prompts that
    are preempted and recomputed, and closed-loop turns arrive late."""
    low, high = 0.0, CAPACITY_SEARCH_MAX * settings.first_guess_rps
    for _ in range(CAPACITY_SEARCH_STEPS):
        rate = (low + high) / 2
        workload = overload_workload(rate, settings.duration_s, settings.seed + 1)
        result, _ = _simulate("no flow control", workload, settings, config_dir)
        if backlog_growth(result.records, settings.duration_s) > UNSTABLE_GROWTH * rate:
            high = rate
        else:
            low = rate
    return low


def run(settings: OverloadSettings, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    config_dir = out_dir / "flow-control-configs"
    config_dir.mkdir(exist_ok=True)
    capacity = settings.capacity_rps or measure_capacity(settings, config_dir)
    runs = []
    for load in settings.loads:
        workload = overload_workload(load * capacity, settings.duration_s, settings.seed)
        tenants = {s.session_id: s.tenant for s in workload.sessions}
        for variant in settings.variants:
            result, queue_s = _simulate(variant, workload, settings, config_dir)
            runs.append(_run_row(load, variant, result, tenants, queue_s, settings))
        if settings.epp_replicas > 1 and load > 1:
            for mode in EPP_REPLICA_MODES:
                result, queue_s = _simulate(settings.replica_variant, workload, settings, config_dir, mode)
                label = f"{settings.replica_variant}, K={settings.epp_replicas} {mode}"
                runs.append(_run_row(load, label, result, tenants, queue_s, settings))
    data = {
        "benchmark": "flow-control",
        "settings": asdict(settings),
        "capacity_rps": capacity,
        "slo_ttft_ms": SLO_TTFT_MS,
        "configs": {v: config_yaml(v, settings) for v in settings.variants},
        "machine": machine(),
        "runs": runs,
        "goals": goals(runs),
    }
    plot = _plot(out_dir, runs, settings)
    json_path, md_path = write_results(out_dir, "flow-control", data, render_markdown(data, plot))
    data["outputs"] = {"json": str(json_path), "markdown": str(md_path), "plot": str(out_dir / plot)}
    return data


def _run_row(
    load: float,
    variant: str,
    result: Any,
    tenants: dict[str, str],
    queue_s: dict[str, float],
    settings: OverloadSettings,
) -> dict[str, Any]:
    span = busy_span(result.records, settings.duration_s)
    per_tenant = tenant_metrics(result.records, tenants, queue_s, span)
    return {
        "load": load,
        "variant": variant,
        "tenants": per_tenant,
        "offered_interactive_rps": _offered(result.records, settings.duration_s),
        "total_goodput_req_s": sum(t["goodput_req_s"] for t in per_tenant.values()),
        "span_s": span,
        "wall_s": result.wall_s,
        "virtual_s": result.virtual_s,
    }


def busy_span(records: Sequence[SimulatedRequest], duration_s: float) -> float:
    """Goodput's denominator: from the first arrival until the last request finished (at least the
    arrival window). A pool that falls behind finishes the last requests long after the arrivals
    stop; counting those over the arrival window alone would credit it with work it did later."""
    return max([duration_s, *(r.finish for r in records if r.finish is not None)])


def _offered(records: Sequence[SimulatedRequest], duration_s: float) -> float:
    """Interactive requests that arrived during the arrival window, per second (closed-loop turns
    arrive later when the pool is slow, so this is below the nominal rate under overload)."""
    return (
        sum(1 for r in records if not r.session_id.startswith("batch") and r.arrival <= duration_s)
        / duration_s
    )


def _run(runs: list[dict[str, Any]], load: float, variant: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["load"] == load and r["variant"] == variant), None)


def goals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 14's goals at 2× load, for each flow-control variant against no flow control."""
    base_low, base_high = _run(runs, 0.5, "no flow control"), _run(runs, 2.0, "no flow control")
    if base_low is None or base_high is None:
        return {}
    b_low = base_low["tenants"]["B"]["ttft_p99_ms"]
    verdicts = {}
    for variant in {r["variant"] for r in runs} - {"no flow control"}:
        high = _run(runs, 2.0, variant)
        if high is None:
            continue
        b_p99 = high["tenants"]["B"]["ttft_p99_ms"]
        verdicts[variant] = {
            "b_ttft_p99_within_1_5x_of_half_load": b_p99 is not None and b_p99 <= 1.5 * b_low,
            "b_ttft_p99_ms": b_p99,
            "b_ttft_p99_half_load_ms": b_low,
            "goodput_at_least_no_flow_control": high["total_goodput_req_s"]
            >= base_high["total_goodput_req_s"],
            "a_queue_p99_ms": high["tenants"]["A"]["queue_p99_ms"],
            "a_shed": high["tenants"]["A"]["shed"],
        }
    return verdicts


def render_markdown(data: dict[str, Any], plot: str) -> str:
    s = data["settings"]
    lines = [
        "# Flow control: two-tenant overload (fleet simulator)",
        "",
        f"{s['replicas']} × `{s['profile']}` replicas; measured capacity "
        f"{data['capacity_rps']:.1f} interactive req/s; {s['duration_s']:.0f} s of arrivals per run; "
        f"tenant A 80% agentic sessions, tenant B 20% chats (TTFT SLO {data['slo_ttft_ms']:.0f} ms), "
        f"batch (priority −1) {BATCH_SHARE:.0%} on top. Seed {s['seed']}.",
        "",
    ]
    headers = [
        "load",
        "policy",
        "tenant",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "SLO att.",
        "goodput req/s",
        "shed",
        "queue p50 ms",
        "queue p99 ms",
    ]
    rows = []
    for run in data["runs"]:
        for tenant, m in run["tenants"].items():
            rows.append(
                [
                    f"{run['load']:g}×",
                    run["variant"],
                    tenant,
                    cell(m["ttft_p50_ms"]),
                    cell(m["ttft_p99_ms"]),
                    cell(m["slo_attainment"], 3),
                    cell(m["goodput_req_s"], 2),
                    m["shed"],
                    cell(m["queue_p50_ms"]),
                    cell(m["queue_p99_ms"]),
                ]
            )
    lines += [markdown_table(headers, rows), ""]
    lines += [
        "Total goodput (req/s): "
        + ", ".join(
            f"{r['load']:g}× {r['variant']}: {r['total_goodput_req_s']:.2f} (over {r['span_s']:.0f} s)"
            for r in data["runs"]
        ),
        "",
    ]
    if data["goals"]:
        lines += ["## Goals at 2× load", ""]
        goal_rows = [
            [
                v,
                cell(g["b_ttft_p99_ms"]),
                cell(g["b_ttft_p99_half_load_ms"]),
                "yes" if g["b_ttft_p99_within_1_5x_of_half_load"] else "no",
                "yes" if g["goodput_at_least_no_flow_control"] else "no",
                cell(g["a_queue_p99_ms"]),
                g["a_shed"],
            ]
            for v, g in sorted(data["goals"].items())
        ]
        lines += [
            markdown_table(
                [
                    "policy",
                    "B TTFT p99 ms",
                    "B p99 at 0.5× (no FC)",
                    "within 1.5×",
                    "goodput ≥ no FC",
                    "A queue p99 ms",
                    "A shed",
                ],
                goal_rows,
            ),
            "",
        ]
    lines += [f"![flow control]({plot})", ""]
    return "\n".join(lines)


def _plot(out_dir: Path, runs: list[dict[str, Any]], settings: OverloadSettings) -> str:
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(settings.variants)
    x = np.arange(len(settings.loads))
    for i, variant in enumerate(settings.variants):
        p99 = [
            (_run(runs, load, variant) or {}).get("tenants", {}).get("B", {}).get("ttft_p99_ms") or 0
            for load in settings.loads
        ]
        goodput = [
            (_run(runs, load, variant) or {}).get("total_goodput_req_s") or 0 for load in settings.loads
        ]
        axes[0].bar(x + i * width, p99, width, label=variant)
        axes[1].bar(x + i * width, goodput, width, label=variant)
    for ax, title in zip(axes, ("tenant B TTFT p99 (ms)", "total goodput (req/s)"), strict=True):
        ax.set_xticks(x + width * (len(settings.variants) - 1) / 2, [f"{load:g}×" for load in settings.loads])
        ax.set_xlabel("offered load (× capacity)")
        ax.set_title(title)
    if any(bar.get_height() > 0 for bar in axes[0].patches):
        axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    return save_figure(figure, out_dir, "flow-control.png")
