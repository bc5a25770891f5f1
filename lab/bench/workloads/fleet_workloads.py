"""The fleet benchmark's workloads, by name, at a load scale.

=========================  ==========================================================================
name                       what it replays
=========================  ==========================================================================
rl-stragglers              RL rollouts as in the Ray token-aware routing study: each step runs 8
                           rollouts of 10 turns that share the step's 2k-token prompt; each turn
                           generates 1k tokens and the next turn's prompt is the whole history plus
                           a 128-token observation; two rollouts per step are stragglers whose last
                           turn generates 8k. Steps are synchronous (a step starts when the previous
                           one's rollouts have all ended); 2 trainers at scale 1, so 16 rollouts
                           in flight; scale s runs round(2s) trainers.
agentic-weka               Claude Code sessions (Weka/SemiAnalysis traces): turn k's prompt = turn
                           k-1's prompt, then its output and new tokens as far as the trace's prompt
                           grew (less than the whole output when the trace dropped some, e.g.
                           thinking); a prompt that shrinks in the trace (a compaction) or would not
                           fit the model window restarts fresh, from the trace's size clipped to
                           half the window; sessions start as a Poisson process
                           (0.05/s x scale), drawn with replacement from the trace's sessions; turns
                           wait the recorded think time, capped at 30 s.
mooncake-conversation      Mooncake's production conversation trace (12,031 requests): recorded
mooncake-synthetic         arrival times divided by the scale, prefix identity from hash_ids (512-
                           token blocks); prompts longer than the window are clipped.
mooncake-conversation-     the conversation trace with each request's arrival drawn uniformly
spread                     (seeded) within its timestamp's bucket: the trace stamps arrivals to
                           ~3 s buckets (up to 28 requests share one stamp), so replayed as
                           recorded every bucket arrives in one instant.
azure-conv, azure-code     Azure LLM inference traces 2023: recorded times divided by the scale,
                           no prefix information (load balancing only).
session-trace:PATH         a session trace in the generic JSONL format of ``bench.workloads.traces``; arrival
                           times divided by the scale.
=========================  ==========================================================================

``limit`` keeps only the first requests (trace workloads) or sessions / steps (the others), for
short runs. Every workload carries default SLOs (overridable), so that goodput and SLO
attainment are defined and the predicted-latency router sees objectives.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import traces
from sim.engine import Profile
from sim.fleet.workload import Session, Turn, Workload

SESSION_TRACE = "session-trace:"
MAX_OUTPUT = 8192


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    scale: float = 1.0
    seed: int = 0
    limit: int | None = None
    max_model_len: int = 131072


Builder = Callable[[WorkloadOptions], Workload]


def rl_stragglers(options: WorkloadOptions) -> Workload:
    rng = random.Random(options.seed)
    trainers = max(1, round(2 * options.scale))
    steps = options.limit or 4
    prompt, output, observation, straggler_output = 2048, 1024, 128, 8192
    sessions = []
    for trainer in range(trainers):
        for step in range(steps):
            group = f"t{trainer}-step{step}"
            stragglers = set(rng.sample(range(8), 2))
            step_prompt = rng.getrandbits(48)
            for rollout in range(8):
                turns, size = [], prompt
                for turn in range(10):
                    last = turn == 9 and rollout in stragglers
                    out = straggler_output if last else output
                    if turn == 0:
                        turns.append(Turn(size, out, prefix="blocks", hash_ids=(step_prompt,)))
                    else:
                        turns.append(Turn(size, out, prefix="previous"))
                    size += out + observation
                sessions.append(
                    Session(
                        f"{group}-r{rollout}",
                        0.0,
                        tuple(turns),
                        group=group,
                        after=f"t{trainer}-step{step - 1}" if step else None,
                    )
                )
    return Workload(
        "rl-stragglers",
        sessions,
        description=(
            f"{trainers} synchronous RL trainers x {steps} steps x 8 rollouts x 10 turns "
            f"({8 * trainers} rollouts in flight), 2k prompt shared per step, 1k output per turn, "
            "2 stragglers per step with an 8k last turn"
        ),
        hash_block_tokens=prompt,
        slo_ttft_ms=1000.0,
        slo_tpot_ms=30.0,
        max_tokens=MAX_OUTPUT,
        params={"trainers": trainers, "steps": steps, "rollouts_in_flight": 8 * trainers},
    )


def agentic_weka(options: WorkloadOptions) -> Workload:
    rng = random.Random(options.seed)
    recorded = list(traces.read_weka(traces.trace_path(traces.WEKA)).values())
    count = options.limit or 48
    rate = 0.05 * options.scale
    max_turns, think_cap = 40, 30.0
    window = options.max_model_len
    sessions, start = [], 0.0
    for index in range(count):
        start += rng.expovariate(rate)
        rows = rng.choice(recorded)[:max_turns]
        turns: list[Turn] = []
        context = previous_input = 0
        for row in rows:
            output = max(1, min(row.output_tokens, MAX_OUTPUT))
            growth = row.input_tokens - previous_input
            size = context + growth
            if not turns or growth < 0 or size + output > window:
                # fresh context: the first turn, a compaction in the trace, or one here
                size = min(row.input_tokens, window // 2, window - output)
                turns.append(Turn(size, output, think_s=min(row.think_s, think_cap)))
            else:
                turns.append(Turn(size, output, prefix="previous", think_s=min(row.think_s, think_cap)))
            context, previous_input = size, row.input_tokens
        sessions.append(Session(f"agent{index}", start, tuple(turns)))
    return Workload(
        "agentic-weka",
        sessions,
        description=(
            f"{count} Claude Code sessions (Weka traces, first {max_turns} turns) starting at "
            f"{rate:.3f}/s (Poisson), think time capped at {think_cap:.0f} s, contexts within {window} tokens"
        ),
        slo_ttft_ms=3000.0,
        slo_tpot_ms=50.0,
        params={"sessions": count, "session_rate_per_s": rate, "max_turns": max_turns},
    )


def spread_over_buckets(arrivals: list[float], rng: random.Random) -> list[float]:
    """``arrivals`` (sorted, stamped to buckets) with each one drawn uniformly between its stamp
    and the next distinct stamp; the last bucket is as wide as the median bucket."""
    if not arrivals:
        return []
    stamps = sorted(set(arrivals))
    width = {a: b - a for a, b in itertools.pairwise(stamps)}
    gaps = sorted(width.values())
    width[stamps[-1]] = gaps[len(gaps) // 2] if gaps else 0.0
    return [t + rng.random() * width[t] for t in arrivals]


def _mooncake(kind: str, spread: bool = False) -> Builder:
    def build(options: WorkloadOptions) -> Workload:
        rows = traces.read_mooncake(traces.trace_path(traces.MOONCAKE[kind]), options.limit)
        arrivals = [row.arrival_s for row in rows]
        if spread:
            arrivals = spread_over_buckets(arrivals, random.Random(options.seed))
        sessions, clipped = [], 0
        for index, (row, arrival_s) in enumerate(zip(rows, arrivals, strict=True)):
            output = min(row.output_tokens, MAX_OUTPUT)
            size = min(row.input_tokens, options.max_model_len - output)
            clipped += size < row.input_tokens
            turn = Turn(size, max(1, output), prefix="blocks", hash_ids=row.hash_ids)
            sessions.append(Session(f"m{index}", arrival_s / options.scale, (turn,)))
        timing = "arrivals spread over their ~3 s buckets" if spread else "recorded arrivals"
        return Workload(
            f"mooncake-{kind}" + ("-spread" if spread else ""),
            sessions,
            description=(
                f"Mooncake {kind} trace, {len(rows)} requests at {options.scale}x the recorded rate "
                f"({timing}), prefixes from hash_ids ({clipped} prompts clipped to the window)"
            ),
            slo_ttft_ms=2000.0,
            slo_tpot_ms=50.0,
            params={"requests": len(rows), "clipped": clipped},
        )

    return build


def _azure(kind: str) -> Builder:
    def build(options: WorkloadOptions) -> Workload:
        rows = traces.read_azure(traces.trace_path(traces.AZURE[kind]), options.limit)
        sessions = [
            Session(
                f"a{index}",
                row.arrival_s / options.scale,
                (Turn(min(row.input_tokens, options.max_model_len - 1), max(1, row.output_tokens)),),
            )
            for index, row in enumerate(rows)
        ]
        return Workload(
            f"azure-{kind}",
            sessions,
            description=f"Azure 2023 {kind} trace, {len(rows)} requests at {options.scale}x its rate",
            slo_ttft_ms=1000.0,
            slo_tpot_ms=50.0,
            params={"requests": len(rows)},
        )

    return build


def session_trace(path: Path, options: WorkloadOptions) -> Workload:
    rows = traces.read_session_trace(path)
    by_session: dict[str, list[traces.SessionTraceRow]] = {}
    for row in rows:
        by_session.setdefault(row.session_id, []).append(row)
    sessions = []
    for session_id, turns in list(by_session.items())[: options.limit]:
        start = turns[0].arrival_s or 0.0
        sessions.append(
            Session(
                session_id,
                start / options.scale,
                tuple(
                    Turn(
                        row.input_tokens,
                        row.output_tokens,
                        prefix=row.prefix,  # type: ignore[arg-type]
                        hash_ids=row.hash_ids,
                        offset_s=None if row.arrival_s is None else (row.arrival_s - start) / options.scale,
                        think_s=row.think_s or 0.0,
                    )
                    for row in turns
                ),
            )
        )
    return Workload(
        f"session-trace:{path.name}",
        sessions,
        description=f"session trace {path} ({len(rows)} requests) at {options.scale}x its rate",
        hash_block_tokens=rows[0].hash_block_tokens if rows else 512,
        slo_ttft_ms=2000.0,
        slo_tpot_ms=50.0,
        params={"path": str(path), "requests": len(rows)},
    )


WORKLOADS: dict[str, Builder] = {
    "rl-stragglers": rl_stragglers,
    "agentic-weka": agentic_weka,
    "mooncake-conversation": _mooncake("conversation"),
    "mooncake-conversation-spread": _mooncake("conversation", spread=True),
    "mooncake-synthetic": _mooncake("synthetic"),
    "azure-conv": _azure("conv"),
    "azure-code": _azure("code"),
}


def workload_names() -> list[str]:
    return [*WORKLOADS, f"{SESSION_TRACE}PATH"]


def build_workload(name: str, options: WorkloadOptions) -> Workload:
    """The workload called ``name`` (see the module docstring) under ``options``."""
    if name.startswith(SESSION_TRACE):
        return session_trace(Path(name[len(SESSION_TRACE) :]), options)
    try:
        builder = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names())}") from None
    workload = builder(options)
    workload.params.update({"scale": options.scale, "seed": options.seed, "limit": options.limit})
    return workload


def pool_workload(
    name: str, profiles: Sequence[Profile], scale: float, seed: int, limit: int | None
) -> Workload:
    """The workload called ``name`` for a pool of ``profiles``: no prompt longer than the
    smallest context among them."""
    max_model_len = min(profile.engine.max_model_len for profile in profiles)
    return build_workload(name, WorkloadOptions(scale, seed, limit, max_model_len))
