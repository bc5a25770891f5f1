"""The live stack's cost per request: what ``make run`` starts, measured process by process.

``overhead`` isolates the EPP behind stub engines. This benchmark runs the stack users get
(``LocalStack``: simulated replicas with the ``instant`` profile, the trainer and predictors,
the EPP with a shipped config, Envoy) plus a second Envoy straight to the same replicas, and
reports for each config:

* **idle**: each process's CPU per second with no traffic (the EPP scrapes every engine's
  ``/metrics`` every 50 ms), so that CPU per request can be given net of it as well: at one
  request at a time, the idle cost spread over a request's wall time is a large share of it;
* **short requests** (a ~200-token completion) at concurrency 1 and 16: requests/s, p50/p99
  with and without the EPP, and CPU per request of every process (EPP, predictors, trainer,
  Envoy, replicas);
* **throughput from wrk** (``bench.harness.wrk``, ``wrk_connections`` connections): the short request
  again, driven by a C load generator, which leaves the stack the CPU the Python one takes;
* **streamed responses** (the same prompt, ``stream_tokens`` tokens streamed back) at
  concurrency 16: every response chunk crosses ext_proc, so EPP CPU per streamed token;
* **growing sessions**: a few chat sessions, interleaved one request at a time, whose prompts
  grow by a few hundred tokens a turn to 30k+ tokens, as coding agents' do. EPP CPU per
  request against turn number, to show whether the cost grows with the conversation; and a
  ~26k-token prompt seen for the first time, then extended once;
* **concurrent sessions**: ``concurrent_sessions`` growing sessions at once, turn by turn (every
  session's next turn sent together): EPP CPU per request under load, net of idle, against the
  turn's prompt size. One request at a time the EPP idles between messages, and on this 2-core
  VM work after an idle gap costs it more CPU than the same work back to back;
* **the gRPC floor**, once per run on the first config's replicas: the short requests (both
  concurrencies, then wrk) through a third Envoy with the gateway's own config, whose ext_proc
  service is ``bench.harness.grpc_floor``, a servicer that only answers. Its CPU per request is what a
  Python ext_proc service pays here before doing any work, the floor under the EPP's figures;
* a py-spy flame graph of the EPP in each phase (SVG), when py-spy is installed, from a shorter
  pass of its own after the measured ones (py-spy stops the EPP at every sample).

Per-request CPU of one request at a time is read from ``/proc/PID/task/*/schedstat``
(nanoseconds), since ``/proc/PID/stat`` counts in 10 ms ticks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.progress import Progress

from bench.harness import wrk
from bench.harness.flame_graph import flame_graph
from bench.harness.grpc_floor import FloorGateway, floor_gateway
from bench.harness.loadgen import closed_loop
from bench.harness.process_cpu import task_cpu_seconds
from sim.envoy_config import gateway_bootstrap
from sim.measure.report import machine, markdown_table, write_results
from sim.processes import Component, free_port, start_envoy
from sim.stack import LocalStack, StackConfig, StackPorts

# ~200 tokens with the tiny model's tokenizer.
SHORT_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10
_VOCABULARY = (
    "def return self import numpy the of to in and for while if else class value index token request "
    "replica cache prefix block latency route score = ( ) [ ] { } : , . + - * / 0 1 2 42"
)
_WORDS = _VOCABULARY.split()


@dataclass
class StackOverheadSettings:
    configs: tuple[str, ...] = ("predicted-latency", "gie-default")
    predictors: int = 2
    replicas: int = 4
    concurrencies: tuple[int, ...] = (1, 16)
    short_s: float = 8.0
    sessions: int = 3
    turns: int = 48
    words_per_turn: int = 450
    concurrent_sessions: int = 8
    first_seen_words: int = 18_500
    stream_tokens: int = 32
    wrk_connections: int = 16
    idle_s: float = 3.0
    flame_graphs: bool = True


@dataclass
class StackUnderTest:
    stack: LocalStack
    direct: Component
    direct_url: str

    @property
    def gateway_url(self) -> str:
        return self.stack.gateway_url

    def processes(self) -> dict[str, list[Component]]:
        s = self.stack
        groups = {"epp": [s.epp], "envoy": [s.envoy], "predictors": s.predictors, "trainer": [s.trainer]}
        groups["replicas"] = s.replicas
        return {name: [c for c in comps if c is not None] for name, comps in groups.items()}

    def cpu(self) -> dict[str, float]:
        return {name: sum(c.cpu_seconds() for c in comps) for name, comps in self.processes().items()}


@contextmanager
def _stack(config: str, settings: StackOverheadSettings) -> Iterator[StackUnderTest]:
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            ports=StackPorts.free(),
            sim_profile="instant",
            epp_config=config,
            predictors=settings.predictors,
            epp_args=["--log-level", "WARNING"],
        )
    )
    direct: Component | None = None
    try:
        stack.start()
        port = free_port()
        bootstrap = gateway_bootstrap(
            listen_port=port, epp_address=None, endpoints_file=stack.cluster_endpoints_file
        )
        direct = start_envoy("gateway-without-epp", bootstrap, stack.workdir)
        yield StackUnderTest(stack, direct, f"http://127.0.0.1:{port}")
    finally:
        if direct is not None:
            direct.stop()
        stack.stop()


@dataclass
class FloorUnderTest:
    """The stack's replicas behind the gateway's Envoy config, with ``bench.harness.grpc_floor`` in the
    EPP's place (its CPU is reported under ``epp``, so the EPP's measurements apply unchanged)."""

    floor: FloorGateway
    replicas: list[Component]
    direct_url: str

    @property
    def gateway_url(self) -> str:
        return self.floor.url

    def cpu(self) -> dict[str, float]:
        return {
            "epp": self.floor.servicer.cpu_seconds(),
            "envoy": self.floor.envoy.cpu_seconds(),
            "replicas": sum(c.cpu_seconds() for c in self.replicas),
        }


def measure_floor(sut: StackUnderTest, settings: StackOverheadSettings) -> dict[str, Any]:
    """The short-request cases through the gRPC floor (it has no idle cost: it scrapes nothing)."""
    stack = sut.stack
    with floor_gateway(stack.replica_ports, stack.cluster_endpoints_file, stack.workdir) as gateway:
        floor = FloorUnderTest(gateway, stack.replicas, sut.direct_url)
        no_idle = {"epp": 0.0}
        return {"short": measure_short(floor, settings, no_idle), "wrk": measure_wrk(floor, settings)}


def _per_request(cpu_delta: dict[str, float], requests: int) -> dict[str, float]:
    return {name: round(seconds / max(1, requests) * 1e3, 3) for name, seconds in cpu_delta.items()}


def measure_idle(sut: StackUnderTest, seconds: float) -> dict[str, float]:
    """CPU ms per second of each process group with no traffic."""
    before = sut.cpu()
    time.sleep(seconds)
    after = sut.cpu()
    return {name: round((after[name] - before[name]) / seconds * 1e3, 2) for name in after}


def _load_case(
    sut: StackUnderTest | FloorUnderTest,
    body: bytes,
    concurrency: int,
    seconds: float,
    idle: dict[str, float],
) -> dict[str, Any]:
    """Closed-loop load without, then with the EPP; CPU is counted over the measured part only."""
    direct = asyncio.run(
        closed_loop(sut.direct_url + "/v1/completions", body, concurrency=concurrency, duration_s=2.0)
    )
    url = sut.gateway_url + "/v1/completions"
    asyncio.run(closed_loop(url, body, concurrency=concurrency, duration_s=0.5, warmup_s=0.0))
    before, started = sut.cpu(), time.perf_counter()
    with_epp = asyncio.run(closed_loop(url, body, concurrency=concurrency, duration_s=seconds, warmup_s=0.0))
    after, elapsed = sut.cpu(), time.perf_counter() - started
    delta = {name: after[name] - before[name] for name in after}
    idle_share = delta["epp"] - idle["epp"] / 1e3 * elapsed
    return {
        "concurrency": concurrency,
        "with_epp": with_epp.summary(),
        "without_epp": direct.summary(),
        "added_p50_ms": round(with_epp.percentile_ms(50) - direct.percentile_ms(50), 3),
        "added_p99_ms": round(with_epp.percentile_ms(99) - direct.percentile_ms(99), 3),
        "cpu_ms_per_request": _per_request(delta, with_epp.requests),
        "epp_net_of_idle_ms_per_request": round(idle_share / max(1, with_epp.requests) * 1e3, 3),
    }


def measure_short(
    sut: StackUnderTest | FloorUnderTest, settings: StackOverheadSettings, idle: dict[str, float]
) -> list[dict[str, Any]]:
    body = json.dumps({"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 1}).encode()
    return [_load_case(sut, body, c, settings.short_s, idle) for c in settings.concurrencies]


def measure_wrk(sut: StackUnderTest | FloorUnderTest, settings: StackOverheadSettings) -> dict[str, Any]:
    """Short requests from wrk at ``settings.wrk_connections``: the stack's throughput without
    the Python load generator's CPU on the same cores. CPU per process group per request."""
    body = json.dumps({"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 1}).encode()
    url = sut.gateway_url + "/v1/completions"
    wrk.post(url, body, settings.wrk_connections, 1)  # warm up
    before = sut.cpu()
    result = wrk.post(url, body, settings.wrk_connections, round(settings.short_s))
    after = sut.cpu()
    delta = {name: after[name] - before[name] for name in after}
    return {
        "connections": settings.wrk_connections,
        "wrk": result.summary(),
        "cpu_ms_per_request": _per_request(delta, result.requests),
    }


def measure_streamed(
    sut: StackUnderTest, settings: StackOverheadSettings, idle: dict[str, float]
) -> dict[str, Any]:
    """Streamed ~200-token completions at the highest concurrency: EPP CPU per streamed token."""
    request = {"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": settings.stream_tokens, "stream": True}
    case = _load_case(sut, json.dumps(request).encode(), max(settings.concurrencies), settings.short_s, idle)
    case["tokens_per_request"] = settings.stream_tokens
    return case


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class _Session:
    messages: list[dict[str, str]] = field(default_factory=list)


def _answered(messages: list[dict[str, str]], response: httpx.Response) -> int:
    """Append the answer in ``response`` to the session's ``messages``; the prompt's token count."""
    response.raise_for_status()
    data = response.json()
    messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or "ok"})
    return data["usage"]["prompt_tokens"]


def _turn(
    client: httpx.Client, url: str, epp_pid: int, epp_idle_ms_per_s: float, messages: list[dict[str, str]]
) -> dict[str, Any]:
    before = task_cpu_seconds(epp_pid)
    start = time.perf_counter()
    response = client.post(url, json={"model": "tiny", "messages": messages, "max_tokens": 8})
    latency = time.perf_counter() - start
    cpu = task_cpu_seconds(epp_pid) - before
    return {
        "prompt_tokens": _answered(messages, response),
        "epp_cpu_ms": round(cpu * 1e3, 3),
        "epp_cpu_net_of_idle_ms": round(cpu * 1e3 - epp_idle_ms_per_s * latency, 3),
        "latency_ms": round(latency * 1e3, 2),
    }


def measure_sessions(
    sut: StackUnderTest, settings: StackOverheadSettings, idle: dict[str, float], seed: int = 7
) -> dict[str, Any]:
    """Interleaved growing sessions, then a long prompt seen first and extended once (their
    texts drawn with ``seed``)."""
    assert sut.stack.epp is not None
    pid = sut.stack.epp.process.pid
    url = sut.stack.gateway_url + "/v1/chat/completions"
    rng = random.Random(seed)
    idle_rate = idle["epp"]
    sessions = [
        _Session([{"role": "system", "content": f"You are coding agent {i}."}])
        for i in range(settings.sessions)
    ]
    turns: list[dict[str, Any]] = []
    with httpx.Client(timeout=120) as client:
        for turn in range(settings.turns):
            for index, session in enumerate(sessions):
                session.messages.append({"role": "user", "content": _text(rng, settings.words_per_turn)})
                turns.append(
                    {"turn": turn, "session": index, **_turn(client, url, pid, idle_rate, session.messages)}
                )
        fresh = [{"role": "user", "content": _text(rng, settings.first_seen_words)}]
        first_seen = _turn(client, url, pid, idle_rate, fresh)
        fresh.append({"role": "user", "content": _text(rng, settings.words_per_turn)})
        extension = _turn(client, url, pid, idle_rate, fresh)
    return {"turns": turns, "first_seen": first_seen, "extension": extension}


def _measure(
    config: str, settings: StackOverheadSettings, out_dir: Path, progress: Progress, with_floor: bool
) -> dict[str, Any]:
    task = progress.add_task(f"stack overhead: {config}", total=3)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _stack(config, settings) as sut:
        if settings.predictors:
            time.sleep(3.0)  # let the first model train, as a user's stack would have
        idle = measure_idle(sut, settings.idle_s)

        short = measure_short(sut, settings, idle)
        progress.advance(task)
        throughput = measure_wrk(sut, settings)
        streamed = measure_streamed(sut, settings, idle)
        progress.advance(task)
        sessions = measure_sessions(sut, settings, idle)
        concurrent = measure_concurrent_sessions(sut, settings, idle)
        if settings.flame_graphs:
            _profile_phases(sut, settings, idle, out_dir, config)
        floor = measure_floor(sut, settings) if with_floor else None
        progress.advance(task)
    return {
        "config": config,
        "idle_cpu_ms_per_s": idle,
        "short": short,
        "wrk": throughput,
        "streamed": streamed,
        "sessions": sessions,
        "concurrent_sessions": concurrent,
        **({"grpc_floor": floor} if floor is not None else {}),
    }


def measure_concurrent_sessions(
    sut: StackUnderTest, settings: StackOverheadSettings, idle: dict[str, float]
) -> list[dict[str, Any]]:
    """``settings.concurrent_sessions`` growing sessions, their turns sent together round by round:
    per round, the EPP's CPU (and net of its idle rate over the round) per request."""
    assert sut.stack.epp is not None
    pid = sut.stack.epp.process.pid
    url = sut.stack.gateway_url + "/v1/chat/completions"
    rng = random.Random(9)
    sessions = [
        [{"role": "system", "content": f"You are coding agent {i} of a team."}]
        for i in range(settings.concurrent_sessions)
    ]

    async def rounds() -> list[dict[str, Any]]:
        results = []
        async with httpx.AsyncClient(timeout=120) as client:
            for turn in range(settings.turns):
                for messages in sessions:
                    messages.append({"role": "user", "content": _text(rng, settings.words_per_turn)})
                bodies = [{"model": "tiny", "messages": m, "max_tokens": 8} for m in sessions]
                before, started = task_cpu_seconds(pid), time.perf_counter()
                responses = await asyncio.gather(*(client.post(url, json=body) for body in bodies))
                wall, cpu = time.perf_counter() - started, task_cpu_seconds(pid) - before
                tokens = [_answered(m, r) for m, r in zip(sessions, responses, strict=True)]
                count = len(sessions)
                results.append(
                    {
                        "turn": turn,
                        "prompt_tokens": sorted(tokens)[count // 2],
                        "epp_cpu_ms": round(cpu / count * 1e3, 3),
                        "epp_cpu_net_of_idle_ms": round((cpu * 1e3 - idle["epp"] * wall) / count, 3),
                        "round_ms": round(wall * 1e3, 2),
                    }
                )
        return results

    return asyncio.run(rounds())


def _profile_phases(
    sut: StackUnderTest, settings: StackOverheadSettings, idle: dict[str, float], out_dir: Path, config: str
) -> None:
    """A py-spy flame graph of the EPP in each phase, from shorter passes after the measured ones:
    py-spy stops the EPP at every sample, which would otherwise add to the figures (on this
    2-core machine a sampled pass gave 2.3 ms added p50 at concurrency 1 against 1.6 unsampled)."""
    assert sut.stack.epp is not None
    pid = sut.stack.epp.process.pid
    brief = replace(settings, short_s=3.0, concurrencies=(max(settings.concurrencies),), turns=8)
    phases = {
        "short": lambda: measure_short(sut, brief, idle),
        "streamed": lambda: measure_streamed(sut, brief, idle),
        "sessions": lambda: measure_sessions(sut, brief, idle, seed=8),
    }
    for phase, measure in phases.items():
        with flame_graph(pid, out_dir / f"stack-{config}-{phase}.svg", rate=250):
            measure()


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    for result in results:
        turns = result["sessions"]["turns"]
        ax.scatter(
            [t["prompt_tokens"] for t in turns], [t["epp_cpu_ms"] for t in turns], s=8, label=result["config"]
        )
    for result in results:
        rounds = result["concurrent_sessions"]
        ax.scatter(
            [r["prompt_tokens"] for r in rounds],
            [r["epp_cpu_ms"] for r in rounds],
            s=14,
            marker="x",
            label=f"{result['config']}, sessions at once",
        )
    ax.set_xlabel("prompt tokens (each turn extends the session's previous prompt)")
    ax.set_ylabel("EPP CPU per request (ms)")
    ax.set_title("EPP CPU per request in growing chat sessions (live stack)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_BANDS = [(0, 8_000), (8_000, 16_000), (16_000, 24_000), (24_000, 40_000)]


def _band_rows(config: str, label: str, turns: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per prompt-size band of ``turns`` (the first turn left out: it is seen first)."""
    rows = []
    for low, high in _BANDS:
        band = [t for t in turns if low <= t["prompt_tokens"] < high and t["turn"] > 0]
        if band:
            cpu = sorted(t["epp_cpu_ms"] for t in band)
            net = sorted(t["epp_cpu_net_of_idle_ms"] for t in band)
            size = f"{low // 1000}k–{high // 1000}k"
            rows.append([config, label, size, len(band), cpu[len(cpu) // 2], cpu[-1], net[len(net) // 2]])
    return rows


def _session_rows(result: dict[str, Any], concurrent_sessions: int) -> list[list[Any]]:
    config, s = result["config"], result["sessions"]
    rows = _band_rows(config, "one at a time", s["turns"])
    for label in ("first_seen", "extension"):
        turn = s[label]
        size = f"{label} ({turn['prompt_tokens']})"
        net = turn["epp_cpu_net_of_idle_ms"]
        rows.append([config, "one at a time", size, 1, turn["epp_cpu_ms"], "", net])
    together = f"{concurrent_sessions} at once (per round)"
    return rows + _band_rows(config, together, result["concurrent_sessions"])


def _streamed_row(result: dict[str, Any]) -> list[Any]:
    case = result["streamed"]
    per_token = case["epp_net_of_idle_ms_per_request"] / case["tokens_per_request"] * 1e3
    return [
        result["config"],
        case["concurrency"],
        case["tokens_per_request"],
        case["without_epp"]["rps"],
        case["with_epp"]["rps"],
        case["added_p50_ms"],
        case["cpu_ms_per_request"]["epp"],
        round(per_token, 1),
        case["cpu_ms_per_request"]["envoy"],
    ]


def _floor_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    """The floor's short cases and wrk run beside the EPP's (the first config's stack)."""
    rows = []
    for result in results:
        floor = result.get("grpc_floor")
        if floor is None:
            continue
        for who, measured in (("grpc-floor", floor), (result["config"], result)):
            for case in measured["short"]:
                net = case["epp_net_of_idle_ms_per_request"]
                load = f"concurrency {case['concurrency']}"
                envoy = case["cpu_ms_per_request"]["envoy"]
                rows.append([who, load, case["with_epp"]["rps"], case["added_p50_ms"], net, envoy])
            run = measured["wrk"]
            cpu = run["cpu_ms_per_request"]
            load = f"wrk, {run['connections']} connections"
            rows.append([who, load, run["wrk"]["rps"], "", cpu["epp"], cpu["envoy"]])
    return rows


def _markdown(data: dict[str, Any]) -> str:
    short_rows = []
    for result in data["results"]:
        for case in result["short"]:
            cpu = case["cpu_ms_per_request"]
            short_rows.append(
                [
                    result["config"],
                    case["concurrency"],
                    case["without_epp"]["rps"],
                    case["with_epp"]["rps"],
                    case["added_p50_ms"],
                    case["added_p99_ms"],
                    cpu["epp"],
                    case["epp_net_of_idle_ms_per_request"],
                    cpu["predictors"],
                    cpu["trainer"],
                    cpu["envoy"],
                    cpu["replicas"],
                ]
            )
    short = markdown_table(
        ["config", "conc.", "rps w/o EPP", "rps with EPP", "added p50 ms", "added p99 ms", "EPP CPU ms/req",
         "EPP net of idle", "predictors", "trainer", "Envoy", "replicas"],
        short_rows,
    )  # fmt: skip
    throughput = markdown_table(
        ["config", "connections", "rps", "errors", "p50 ms", "p99 ms", "EPP CPU ms/req", "Envoy", "replicas"],
        [
            [r["config"], r["wrk"]["connections"], r["wrk"]["wrk"]["rps"], r["wrk"]["wrk"]["errors"],
             r["wrk"]["wrk"]["p50_ms"], r["wrk"]["wrk"]["p99_ms"], r["wrk"]["cpu_ms_per_request"]["epp"],
             r["wrk"]["cpu_ms_per_request"]["envoy"], r["wrk"]["cpu_ms_per_request"]["replicas"]]
            for r in data["results"]
        ],
    )  # fmt: skip
    streamed = markdown_table(
        ["config", "conc.", "tokens/req", "rps w/o EPP", "rps with EPP", "added p50 ms", "EPP CPU ms/req",
         "EPP µs/token (net of idle)", "Envoy CPU ms/req"],
        [_streamed_row(result) for result in data["results"]],
    )  # fmt: skip
    idle = markdown_table(
        ["config", *data["results"][0]["idle_cpu_ms_per_s"]],
        [[r["config"], *r["idle_cpu_ms_per_s"].values()] for r in data["results"]],
    )
    concurrent_sessions = data["settings"]["concurrent_sessions"]
    sessions = markdown_table(
        ["config", "sessions", "prompt tokens", "requests", "EPP CPU ms p50", "max", "p50 net of idle"],
        [row for result in data["results"] for row in _session_rows(result, concurrent_sessions)],
    )
    floor = markdown_table(
        ["ext_proc service", "load", "rps", "added p50 ms", "service CPU ms/req (net of idle)", "Envoy"],
        _floor_rows(data["results"]),
    )
    m = data["machine"]
    return "\n\n".join(
        [
            "# Live stack overhead",
            f"Machine: {m['cpus']} CPUs, Python {m['python']}, Envoy {m['envoy']}, {m['date']}. The load "
            "generator, both Envoys, the EPP, predictors, trainer and simulated replicas share these CPUs.",
            "## Idle (CPU ms per second, no traffic)",
            idle,
            "## Short requests (~200-token completions, `instant` simulated replicas)",
            "CPU columns are ms of CPU per request through the EPP gateway, per process group; "
            "'net of idle' takes the EPP's idle CPU rate over the same time away.",
            short,
            "## Throughput from wrk (short requests; a C load generator, far cheaper on the shared CPUs)",
            throughput,
            "## The gRPC floor (a servicer that only answers, in the EPP's place)",
            "The same Envoy config and replicas. What a Python ext_proc service costs per request "
            "on this machine before doing any work; "
            "the EPP's rows (wrk's not net of idle) are repeated from above. wrk's CPU is over the "
            "whole run.",
            floor,
            "## Streamed responses (every chunk crosses ext_proc)",
            streamed,
            "## Growing chat sessions",
            "One at a time: the sessions' turns interleaved, one request in flight; net of idle takes "
            "the EPP's idle CPU rate times the request's latency away. At once: every session's next "
            "turn sent together; a round's EPP CPU (net of the idle rate over the round) per request.",
            sessions,
            "![EPP CPU per turn](stack-overhead.png)",
            "Flame graphs of the EPP (py-spy): `stack-<config>-short.svg`, `stack-<config>-streamed.svg`, "
            "`stack-<config>-sessions.svg`.",
        ]
    )


def run(out_dir: Path, settings: StackOverheadSettings | None = None) -> dict[str, Any]:
    settings = settings or StackOverheadSettings()
    with Progress() as progress:
        results = [
            _measure(config, settings, out_dir, progress, with_floor=i == 0)
            for i, config in enumerate(settings.configs)
        ]
    data = {"machine": machine(), "settings": settings.__dict__, "results": results}
    write_results(out_dir, "stack-overhead", data, _markdown(data))
    _plot(results, out_dir / "stack-overhead.png")
    return data
