"""``llm-epp-bench``: benchmarks, each writing JSON + Markdown + PNG into ``--out``.

=========  ==================================================================================
name       what it measures
=========  ==================================================================================
overhead   the EPP's added latency, throughput and CPU through real Envoy (stub engines)
stack      the ``make run`` stack's CPU per request, process by process: short requests, and
           growing chat sessions to 30k+ tokens (EPP CPU against turn); py-spy flame graphs
idle       EPP CPU per second with no traffic against the pool's size (4 and 100 stub engines),
           idle endpoints on the slow scrape tick and all on the fast one
           (``idle --pool-sizes 4,100 --idle-s 10``; see lab/bench/runs/idle_cost.py)
inflight   EPP CPU against time in flight: one long streamed and one non-streamed request at a
           time (net of idle, per chunk, per second in flight, by thread); py-spy flame graphs
metering   a streamed answer's EPP and Envoy CPU (1 and 512 tokens) under each response metering:
           every chunk, or the first token and Envoy's access log
request-rate  the EPP's and Envoy's CPU per request at 50 and 150 requests/s open loop through the
           ``make run`` stack (~1k-token prompts), over each callout (ext_proc, ext_authz;
           lab/bench/runs/request_rate.py)
callout-floor  each callout's cost before any work: a servicer that only picks, behind the
           gateway's Envoy, at 150 requests/s (lab/bench/runs/callout_floor.py)
capacity   each unit cost measured here (request, metered chunk, access-log entry, scrape, sync
           message and endpoint total, prediction row), and the sizing they give for 1k/5k/10k
           QPS over 100 pods (EPP cores and replicas, predictor servers, NATS messages/s, sync
           CPU), llm-d's published figures beside them (~2 min; see lab/bench/runs/capacity.py)
predictor  predictor throughput/latency, trainer retrain time, prediction error (MAPE)
           (``predictor --throughput-only``: one model, its serving cost only)
fidelity   the simulator (tiny-cpu profile) against real vLLM at three load levels
published  the llama-3.1-8b-h100 profile's TTFT/TPOT against a published vLLM measurement of
           the same model on one H100 (virtual time; see lab/bench/runs/published_check.py)
kv-index   precise prefix index: lookup time (100k tokens, 64 endpoints), memory, event ingest
oversized  the EPP's CPU to refuse a 10 MiB prompt over the context (in process, through Envoy)
tokenize   parse + tokenize + block hashes of a 26k-token chat turn, first seen and extending a
           seen one, with and without the tokenizer cache (in process)
sync       active-active EPPs: sync lag through real NATS at 100 and 1,000 requests/s; requests/s
           and CPU per request through Envoy with one EPP process and with two
sync-apply a replica's CPU for applying 3 peers' sync (100 endpoints) at 100, 1,000 and
           10,000 requests/s pool-wide (in process, virtual time)
scrape-share  each of K = 1, 2, 4 synced EPPs' CPU scraping 100 stub engines on the fast tick,
           with scrape sharing and without; a shared figure's apply cost (in process; ~2 min;
           see lab/bench/runs/scrape_share_cost.py)
sync-failures  two active-active EPPs: one killed under load (FailOpen, FailClose), a
           cancellation soak, NATS stopped for 10 s under load; failures and recovery times
compare    one workload replayed through several routers on the fleet simulator
           (``compare --workload NAME --routers LIST|all --replicas N``; see lab/bench/runs/compare.py)
fleet      a short default set of ``compare`` runs (RL stragglers, agentic, Mooncake)
mixed      two mixed pools (2 fast + 2 engines 2.5x slower; 1 H100 + 3 smaller engines), every
           router and the oracle at 50/70/90% of each pool's measured capacity, on the Mooncake
           trace (``mixed --limit 600 --routers all``, ~14 min; see lab/bench/runs/mixed.py)
prediction-floor  one router's TTFT/TPOT predictions against what the state at each decision
           determines (a copy of the engine run with no later arrival; ~5 min; see
           lab/bench/runs/prediction_floor.py)
sync-sweep K EPP replicas x sync delay on the fleet simulator: what replica sync is worth
           (``sync-sweep --router-replicas 1,2,4,8 --sync-delays-ms 0,50,500,none``; see
           lab/bench/runs/sync_sweep.py)
flow-control  a two-tenant overload on the fleet simulator, without flow control and with each
           fairness policy: per tenant TTFT, SLO attainment, goodput, shed, queue time
           (``flow-control --loads 0.5,1.5,2 --duration 60``; see lab/bench/runs/flow_control.py)
replay     a trace replayed in real time through the live stack, one config after another, with
           client-side TTFT/TPOT/E2E, CPU per process and the engines' scheduling lag
           (``replay --workload NAME --duration S``; see lab/bench/runs/live_replay.py)
all        every benchmark above except a custom ``compare``, ``sync-sweep`` and ``replay``
=========  ==================================================================================
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.runs import (
    callout_floor,
    capacity,
    compare,
    flow_control,
    idle_cost,
    inflight_cost,
    kv_index_bench,
    live_replay,
    metering_cost,
    mixed,
    overhead,
    oversized_prompt,
    prediction_floor,
    predictor_bench,
    published_check,
    request_rate,
    scrape_share_cost,
    stack_overhead,
    sync_apply,
    sync_bench,
    sync_failures,
    sync_sweep,
    tls_cost,
    tokenize_bench,
)
from bench.workloads.fleet_workloads import workload_names
from sim.engine import ProfileError, available_profiles
from sim.engine.pool import check_pool, pool_size
from sim.fitting import fidelity
from sim.fleet import router_names

FLEET_DEFAULTS = (
    compare.CompareSettings(
        "rl-stragglers",
        ("random", "gie-default", "predicted-latency", "oracle"),
        replicas=4,
        rate_scales=(1.0, 2.0),
        limit=2,
    ),
    compare.CompareSettings(
        "agentic-weka",
        ("random", "gie-default", "predicted-latency", "oracle"),
        replicas=4,
        rate_scales=(1.0,),
        limit=16,
    ),
    compare.CompareSettings(
        "mooncake-conversation",
        ("random", "gie-default", "predicted-latency", "oracle"),
        replicas=8,
        rate_scales=(1.0,),
        limit=1500,
    ),
)


def run_fleet_defaults(out_dir: Path) -> None:
    for settings in FLEET_DEFAULTS:
        compare.run(settings, out_dir)


BENCHMARKS: dict[str, Callable[[Path], Any]] = {
    "overhead": overhead.run,
    "stack": stack_overhead.run,
    "idle": idle_cost.run,
    "inflight": inflight_cost.run,
    "metering": metering_cost.run,
    "request-rate": request_rate.run,
    "callout-floor": callout_floor.run,
    "capacity": capacity.run,
    "predictor": predictor_bench.run,
    "fidelity": fidelity.run,
    "published": published_check.run,
    "kv-index": kv_index_bench.run,
    "oversized": oversized_prompt.run,
    "tokenize": tokenize_bench.run,
    "sync": sync_bench.run,
    "sync-apply": sync_apply.run,
    "scrape-share": scrape_share_cost.run,
    "sync-failures": sync_failures.run,
    "tls": tls_cost.run,
    "fleet": run_fleet_defaults,
    "mixed": lambda out: mixed.run(mixed.MixedSettings(), out),
    "prediction-floor": lambda out: prediction_floor.run(prediction_floor.FloorSettings(), out),
}


def _add_subcommand(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser, with the ``--out`` folder every benchmark writes its results to."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--out", type=Path, default=Path("results"))
    return p


def _scales(text: str) -> tuple[float, ...]:
    try:
        scales = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate scales must be numbers, got {text!r}") from None
    if not scales or min(scales) <= 0:
        raise argparse.ArgumentTypeError("give one or more positive rate scales")
    return scales


def _pool(text: str) -> str:
    """A pool spec (``sim.engine.pool``): ``NAME`` or ``NAME[+KEY=VALUE...]:COUNT,...``."""
    try:
        check_pool(text)
    except ProfileError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (profiles: {', '.join(available_profiles())})") from None
    return text


POOL_HELP = (
    "engine profile, or a mixed pool NAME[+KEY=VALUE...]:COUNT,... (KEY among max_num_seqs, "
    "max_num_batched_tokens, num_gpu_blocks, slowdown), e.g. llama-3.1-8b-h100:2,llama-3.1-8b-a100:2"
)


def _replica_count(parser: argparse.ArgumentParser, profile: str, replicas: int | None, default: int) -> int:
    """``--replicas``, or a mixed pool's size (the two must agree when both are given)."""
    size = pool_size(profile)
    if size is not None and replicas is not None and replicas != size:
        parser.error(f"--replicas {replicas} disagrees with the {size} replicas of --profile {profile}")
    count = size or replicas or default
    if count < 1:
        parser.error("--replicas must be >= 1")
    return count


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = _add_subcommand(sub, "compare", "replay one workload through several routers (fleet simulator)")
    p.add_argument("--workload", required=True, help=f"one of: {', '.join(workload_names())}")
    p.add_argument(
        "--routers", default="all", help=f"comma-separated names or 'all' ({', '.join(router_names())})"
    )
    p.add_argument("--replicas", type=int, default=None, help="default 8, or a mixed pool's size")
    p.add_argument("--rate-scales", type=_scales, default=(1.0,), help="e.g. 0.5,1,2,4 (past saturation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=_pool, default="llama-3.1-8b-h100", help=POOL_HELP)
    p.add_argument("--limit", type=int, default=None, help="first N requests / sessions / RL steps")
    p.add_argument("--scrape-interval-ms", type=float, default=50.0)
    p.add_argument("--retrain-interval-s", type=float, default=10.0, help="the live trainer's default")
    p.add_argument(
        "--estimated-tokens",
        type=_scales,
        default=(),
        help="also run each router on token counts estimated from the text (no tokenizer; "
        "docs/tokenizer.md), for text of these bytes a token, e.g. 3,4,5",
    )
    p.add_argument(
        "--calibrated-estimates",
        action="store_true",
        help="with --estimated-tokens: also each with the estimate at the text's bytes a token, as "
        "an EPP sampling the model's tokenizer does (--tokenize-every; labelled ROUTER~calB)",
    )
    p.add_argument(
        "--joins-at-s",
        type=_join_times,
        default=(),
        help="virtual seconds at which the last replicas join the pool, e.g. 60 (the last one at 60 s)",
    )
    p.add_argument(
        "--output-hint",
        type=_output_hint,
        default=None,
        help="clients send x-expected-output-tokens: 'exact' (the true length) or 'noisy:SIGMA' "
        "(the true length times exp(N(0, SIGMA)))",
    )


def _output_hint(text: str) -> float:
    """``exact`` → 0, ``noisy:SIGMA`` → SIGMA (the hint's lognormal noise)."""
    if text == "exact":
        return 0.0
    kind, _, sigma = text.partition(":")
    try:
        value = float(sigma)
    except ValueError:
        value = -1.0
    if kind != "noisy" or not 0 < value <= 5:
        raise argparse.ArgumentTypeError(
            f"--output-hint is 'exact' or 'noisy:SIGMA' (0 < SIGMA <= 5), got {text!r}"
        )
    return value


def _join_times(text: str) -> tuple[float, ...]:
    try:
        times = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"join times are seconds, got {text!r}") from None
    if not times or min(times) < 0:
        raise argparse.ArgumentTypeError("give one or more join times >= 0")
    return times


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = _add_subcommand(sub, "replay", "replay a trace in real time through the live stack, config by config")
    p.add_argument("--workload", default="agentic-weka", help=f"one of: {', '.join(workload_names())}")
    p.add_argument(
        "--configs",
        default=",".join(live_replay.DEFAULT_CONFIGS),
        help="comma-separated EndpointPickerConfig names or paths, run one after another",
    )
    p.add_argument("--rate-scale", type=_positive, default=1.0, help="load scale, as the workload defines it")
    p.add_argument("--duration", type=_positive, default=150.0, help="seconds in which requests are sent")
    p.add_argument("--limit", type=int, default=None, help="first N sessions / requests of the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=_pool, default="default", help=POOL_HELP + " (or a YAML path)")
    p.add_argument("--replicas", type=int, default=None, help="default 4, or a mixed pool's size")
    p.add_argument("--predictors", type=int, default=2, help="for the configs that predict latency")
    p.add_argument(
        "--side-by-side", action="store_true", help="run the configs at the same time, each on its own stack"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="replay the configs this many times in turn (A, B, A, B, ...), each on a fresh stack",
    )
    p.add_argument(
        "--virtual",
        action="store_true",
        help="replay the same workload and window in the fleet simulator (virtual time) instead",
    )


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"replica counts must be integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("give one or more replica counts >= 1")
    return counts


def _delays(text: str) -> tuple[float | None, ...]:
    """Comma-separated milliseconds, or ``none`` for replicas that never sync; in seconds."""
    delays: list[float | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.lower() == "none":
            delays.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"sync delays are milliseconds or 'none', got {part!r}"
            ) from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"a sync delay cannot be negative, got {part!r}")
        delays.append(value / 1e3)
    if not delays:
        raise argparse.ArgumentTypeError("give one or more sync delays")
    return tuple(delays)


def _add_sync_sweep(sub: argparse._SubParsersAction) -> None:
    p = _add_subcommand(sub, "sync-sweep", "K EPP replicas x sync delay on the fleet simulator")
    defaults = sync_sweep.SweepSettings()
    p.add_argument(
        "--workloads",
        default=",".join(w.name for w in sync_sweep.DEFAULT_WORKLOADS),
        help="comma-separated NAME[:RATE_SCALE[:ENGINES[:LIMIT]]] among "
        + ", ".join(f"{w.name}:{w.rate_scale:g}:{w.engines}:{w.limit}" for w in sync_sweep.WORKLOADS)
        + " (default: the first three)",
    )
    p.add_argument("--routers", default=",".join(defaults.routers), help="comma-separated router names")
    p.add_argument("--router-replicas", type=_counts, default=defaults.router_replicas, help="K values")
    p.add_argument(
        "--sync-delays-ms", type=_delays, default=defaults.sync_delays_s, help="d values, e.g. 0,50,500,none"
    )
    p.add_argument(
        "--seeds", type=_seeds, default=defaults.seeds, help="comma-separated seeds; cells average over them"
    )
    p.add_argument(
        "--profile", type=_pool, default=defaults.profile, help=POOL_HELP + "; a mixed pool sets ENGINES"
    )
    p.add_argument(
        "--share-scrapes",
        action="store_true",
        help="synced replicas share their scrapes: each engine's non-owners read them up to a tick late",
    )


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError("give one or more distinct seeds")
    return seeds


def _sweep_workload(text: str) -> sync_sweep.SweepWorkload:
    """``NAME[:RATE_SCALE[:ENGINES[:LIMIT]]]``; what is left out comes from the defaults."""
    known = {w.name: w for w in sync_sweep.WORKLOADS}
    name, *rest = text.strip().split(":")
    if name not in known or len(rest) > 3:
        raise ValueError(f"workloads are NAME[:RATE_SCALE[:ENGINES[:LIMIT]]], NAME among {', '.join(known)}")
    spec = known[name]
    try:
        scale = float(rest[0]) if rest else spec.rate_scale
        engines = int(rest[1]) if len(rest) > 1 else spec.engines
        limit = int(rest[2]) if len(rest) > 2 else spec.limit
    except ValueError:
        raise ValueError(f"{text!r}: the rate scale is a number, engines and limit are integers") from None
    if scale <= 0 or engines < 1 or (limit is not None and limit < 1):
        raise ValueError(f"{text!r}: the rate scale must be positive, engines and limit >= 1")
    return sync_sweep.SweepWorkload(name, scale, engines, limit)


def _add_flow_control(sub: argparse._SubParsersAction) -> None:
    p = _add_subcommand(
        sub, "flow-control", "two-tenant overload with and without flow control (fleet simulator)"
    )
    defaults = flow_control.OverloadSettings()
    p.add_argument("--loads", type=_scales, default=defaults.loads, help="offered load, x measured capacity")
    p.add_argument(
        "--variants", default=",".join(defaults.variants), help="comma-separated, among the defaults"
    )
    p.add_argument(
        "--duration", type=_positive, default=defaults.duration_s, help="seconds of arrivals per run"
    )
    p.add_argument("--replicas", type=int, default=defaults.replicas)
    p.add_argument(
        "--max-tokens-per-endpoint",
        type=int,
        default=defaults.max_tokens_per_endpoint,
        help="token-load detector room per replica (default: the profile's KV cache in tokens)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=defaults.profile, choices=available_profiles())
    p.add_argument(
        "--epp-replicas",
        type=int,
        default=defaults.epp_replicas,
        help="above 1: also run --replica-variant with this many synced EPP replicas (per-replica "
        "and pool-wide token load) at each load above 1x",
    )
    p.add_argument("--replica-variant", default=defaults.replica_variant, help="among --variants' choices")
    p.add_argument(
        "--isolated-prefill-tokens",
        type=int,
        default=defaults.isolated_prefill_tokens,
        help="the prefill isolation variants' isolatedPrefillTokens",
    )
    p.add_argument(
        "--capacity", type=_positive, default=None, help="the pool's capacity in req/s (default: measured)"
    )


def _flow_control(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in flow_control.VARIANTS]
    if unknown or not variants or args.replica_variant not in flow_control.VARIANTS:
        parser.error(
            f"--variants and --replica-variant must be among {', '.join(flow_control.VARIANTS)}; "
            f"got {unknown or variants or 'none'}, {args.replica_variant!r}"
        )
    if args.isolated_prefill_tokens < 1:
        parser.error("--isolated-prefill-tokens must be >= 1")
    tokens = args.max_tokens_per_endpoint
    if args.replicas < 1 or args.epp_replicas < 1 or (tokens is not None and tokens < 1):
        parser.error("--replicas, --epp-replicas and --max-tokens-per-endpoint must be >= 1")
    settings = flow_control.OverloadSettings(
        loads=args.loads,
        variants=variants,
        duration_s=args.duration,
        replicas=args.replicas,
        profile=args.profile,
        max_tokens_per_endpoint=args.max_tokens_per_endpoint,
        epp_replicas=args.epp_replicas,
        replica_variant=args.replica_variant,
        isolated_prefill_tokens=args.isolated_prefill_tokens,
        capacity_rps=args.capacity,
        seed=args.seed,
    )
    flow_control.run(settings, args.out)


def _sync_sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        workloads = tuple(_sweep_workload(part) for part in args.workloads.split(",") if part.strip())
    except ValueError as exc:
        parser.error(str(exc))
    routers = compare.resolve_routers(args.routers)
    if not workloads:
        parser.error("--workloads names no workload")
    if not routers or any(name not in router_names() or name == "oracle" for name in routers):
        parser.error("--routers must name shipped configs (the oracle has no replicas)")
    settings = sync_sweep.SweepSettings(
        workloads=workloads,
        routers=routers,
        router_replicas=args.router_replicas,
        sync_delays_s=args.sync_delays_ms,
        seeds=args.seeds,
        profile=args.profile,
        share_scrapes=args.share_scrapes,
    )
    sync_sweep.run(settings, args.out)


def _replay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    configs = tuple(name.strip() for name in args.configs.split(",") if name.strip())
    if not configs:
        parser.error("--configs names no config")
    replicas = _replica_count(parser, args.profile, args.replicas, 4)
    if args.predictors < 1 or args.rounds < 1:
        parser.error("--predictors and --rounds must be >= 1")
    if args.virtual and (unknown := [c for c in configs if c not in router_names()]):
        parser.error(f"--virtual takes the fleet simulator's router names, not {', '.join(unknown)}")
    settings = live_replay.ReplaySettings(
        workload=args.workload,
        configs=configs,
        rate_scale=args.rate_scale,
        duration_s=args.duration,
        limit=args.limit,
        seed=args.seed,
        profile=args.profile,
        replicas=replicas,
        predictors=args.predictors,
        side_by_side=args.side_by_side,
        rounds=args.rounds,
    )
    try:
        for config in configs:
            live_replay.uses_predictor(config)
        plan = live_replay.build(settings)
    except (FileNotFoundError, ValueError) as exc:  # unknown config, workload or profile; a bad trace
        parser.error(str(exc))
    if args.virtual:
        live_replay.run_virtual(settings, args.out, plan[0])
    else:
        live_replay.run(settings, args.out, plan)


def _add_sync_failures(p: argparse.ArgumentParser) -> None:
    defaults = sync_failures.SyncFailureSettings()
    p.add_argument("--after-kill", type=_positive, default=defaults.after_kill_s, help="seconds of load")
    p.add_argument("--outage", type=_positive, default=defaults.outage_s, help="seconds NATS is down")
    p.add_argument("--soak-streams", type=int, default=defaults.soak_streams)


def _add_predictor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--throughput-only",
        action="store_true",
        help="train one model and measure only the predictor's serving cost (about a minute)",
    )


def _add_idle(p: argparse.ArgumentParser) -> None:
    defaults = idle_cost.IdleSettings()
    p.add_argument(
        "--pool-sizes",
        type=_counts,
        default=defaults.pool_sizes,
        help="comma-separated endpoint counts (default: %(default)s)",
    )
    p.add_argument("--idle-s", type=_positive, default=defaults.idle_s, help="seconds each reading lasts")


def _idle(_parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    idle_cost.run(args.out, idle_cost.IdleSettings(pool_sizes=args.pool_sizes, idle_s=args.idle_s))


def _predictor(_parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    predictor_bench.run(
        args.out, predictor_bench.PredictorBenchSettings(throughput_only=args.throughput_only)
    )


def _sync_failures(_parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    settings = sync_failures.SyncFailureSettings(
        after_kill_s=args.after_kill, outage_s=args.outage, soak_streams=max(1, args.soak_streams)
    )
    sync_failures.run(args.out, settings)


def _add_mixed(p: argparse.ArgumentParser) -> None:
    defaults = mixed.MixedSettings()
    p.add_argument("--limit", type=int, default=defaults.limit, help="first N requests of the trace per run")
    p.add_argument("--routers", default="all", help="comma-separated router names, or all (with the oracle)")
    p.add_argument("--loads", type=_scales, default=defaults.loads, help="fractions of each pool's capacity")
    p.add_argument("--seed", type=int, default=defaults.seed)


def _is_router(name: str) -> bool:
    """A router's name, or a file holding a router's config."""
    return name in router_names() or Path(name).is_file()


def _add_prediction_floor(p: argparse.ArgumentParser) -> None:
    defaults = prediction_floor.FloorSettings()
    p.add_argument("--workload", default=defaults.workload, help=f"one of: {', '.join(workload_names())}")
    p.add_argument("--profile", default=defaults.profile, help="engine profile, or a mixed pool (as compare)")
    p.add_argument("--replicas", type=int, default=defaults.replicas, help="a mixed pool's size, or how many")
    p.add_argument("--rate-scale", type=float, default=defaults.rate_scale)
    p.add_argument("--limit", type=int, default=defaults.limit, help="first N requests / sessions / RL steps")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--router", default=defaults.router, help="a router name or a config file")


def _prediction_floor(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not _is_router(args.router):
        parser.error(f"unknown router {args.router!r}")
    if args.limit < 1 or args.rate_scale <= 0:
        parser.error("--limit must be at least 1 and --rate-scale above 0")
    settings = prediction_floor.FloorSettings(
        args.workload, args.profile, args.replicas, args.rate_scale, args.limit, args.seed, args.router
    )
    try:
        prediction_floor.run(settings, args.out)
    except ValueError as exc:
        parser.error(str(exc))


def _mixed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    routers = compare.resolve_routers(args.routers)
    if unknown := [name for name in routers if name not in router_names()]:
        parser.error(f"unknown routers {unknown}")
    if args.limit < 1:
        parser.error("--limit must be at least 1")
    mixed.run(
        mixed.MixedSettings(limit=args.limit, routers=routers, loads=args.loads, seed=args.seed), args.out
    )


def _compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    routers = compare.resolve_routers(args.routers)
    unknown = [name for name in routers if not _is_router(name)]
    if unknown:
        parser.error(f"unknown routers {unknown}")
    settings = compare.CompareSettings(
        workload=args.workload,
        routers=routers,
        replicas=_replica_count(parser, args.profile, args.replicas, 8),
        rate_scales=args.rate_scales,
        seed=args.seed,
        profile=args.profile,
        limit=args.limit,
        scrape_interval_s=args.scrape_interval_ms / 1e3,
        retrain_interval_s=args.retrain_interval_s,
        estimated_tokens=args.estimated_tokens,
        calibrated_estimates=args.calibrated_estimates,
        joins_at_s=args.joins_at_s,
        output_hint_sigma=args.output_hint,
    )
    try:
        compare.run(settings, args.out)
    except ValueError as exc:
        parser.error(str(exc))


_HANDLERS: dict[str, Callable[[argparse.ArgumentParser, argparse.Namespace], None]] = {
    "compare": _compare,
    "replay": _replay,
    "sync-sweep": _sync_sweep,
    "flow-control": _flow_control,
    "sync-failures": _sync_failures,
    "predictor": _predictor,
    "idle": _idle,
    "mixed": _mixed,
    "prediction-floor": _prediction_floor,
}
"""The subcommands with options of their own; the others run a benchmark with its defaults."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llm-epp-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in [*BENCHMARKS, "all"]:
        _add_subcommand(sub, name, "every benchmark" if name == "all" else f"the {name} benchmark")
    _add_compare(sub)
    _add_replay(sub)
    _add_sync_sweep(sub)
    _add_flow_control(sub)
    _add_sync_failures(sub.choices["sync-failures"])
    _add_predictor(sub.choices["predictor"])
    _add_idle(sub.choices["idle"])
    _add_mixed(sub.choices["mixed"])
    _add_prediction_floor(sub.choices["prediction-floor"])
    args = parser.parse_args(argv)
    handler = _HANDLERS.get(args.command)
    if handler is not None:
        handler(parser, args)
    else:
        selected = BENCHMARKS if args.command == "all" else {args.command: BENCHMARKS[args.command]}
        for name, run in selected.items():
            print(f"== {name}")
            run(args.out)
    print(f"results written to {args.out}/")


if __name__ == "__main__":
    main()
