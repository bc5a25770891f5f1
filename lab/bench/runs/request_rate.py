"""What a request costs the EPP at the rate one replica carries, not one at a time.

The capacity plan (``bench.runs.capacity``) needs the EPP's CPU per request at the rate each replica
is planned to take: hundreds a second. Measured a few a second, every request pays alone for
waking gRPC's threads, the event loop and the kernel, work that requests arriving together
share; so does the EPP's work per second while busy (training-sample and access-log batches,
the sidecars' polls). This bench drives the ``make run`` stack (simulated replicas on the
``instant`` profile, so the engines take little of the machine; predicted-latency with its
trainer and predictors; first-token metering) open loop at each of ``rates`` requests a second
for ``seconds``: streamed chat answers of ``output_tokens`` tokens to ~1k-token prompts, each its
own, one in ``slo_every`` with SLO headers. Under first-token metering the EPP's part of a
streamed answer ends at its first token (the rest is the access-log entry), so the answer's
length does not change what it costs the EPP; the streamed chunk's own cost is
``bench.runs.metering_cost``'s. For each rate: the rate achieved, the EPP's and Envoy's CPU per
request (the EPP's net of its idle rate), the ext_proc messages a request took each way (Envoy's
counters), and the client's p50/p99 time to the first token (a rate the stack did not keep up
with shows there). With ``profile``, one more pass at the last
rate under py-spy (which slows the EPP, so it is not measured) gives where the EPP's CPU went
(:func:`cpu_shares`).

    .venv/bin/python -m bench.runs.request_rate [--rates 50,150] [--seconds 10] [--profile]
        [--callouts ext-proc,ext-authz]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import httpx

from bench.harness.flame_graph import flame_graph
from bench.harness.process_cpu import idle_cpu_rate, rare_scrape_args, task_cpu_seconds
from bench.runs.metering_cost import SLO_HEADERS, _prompt
from sim.envoy_config import Callout
from sim.measure.report import machine, markdown_table, write_results
from sim.stack import LocalStack, StackConfig, StackPorts

TokenizerMode = Literal["dir", "sampled", "estimate"]
"""The EPP's tokenizer: the model's on every prompt (``--tokenizer-dir``), on one prompt in
``SAMPLE_EVERY`` (``--tokenize-every``, the rest calibrated estimates), or none
(``--tokenizer-source estimate``)."""
SAMPLE_EVERY = 16
TOKENIZER_LABELS: dict[str, str] = {
    "dir": "the model's",
    "sampled": f"the model's on 1 prompt in {SAMPLE_EVERY}",
    "estimate": "estimated counts",
}


@dataclass
class RequestRateSettings:
    rates: tuple[float, ...] = (50.0, 150.0)
    seconds: float = 10.0
    output_tokens: int = 8
    prompt_words: int = 232
    """~1,000 tokens of the simulator's tokenizer (``bench.runs.metering_cost``)."""
    slo_every: int = 10
    replicas: int = 4
    predictors: int = 2
    idle_s: float = 5.0
    profile: bool = False
    scrape_interval_s: float = 5.0
    """Scrapes are a cost per second of the pool's (``llm-epp-bench idle``, ``capacity``), not
    per request: rare here so that they weigh nothing in any cell."""
    callouts: tuple[Callout, ...] = ("ext-proc",)
    """How the gateway asks the EPP (``llm-epp-stack --callout``): a stack for each, in turn."""
    tokenizer_sources: tuple[TokenizerMode, ...] = ("dir",)
    """The EPP's tokenizer (:data:`TokenizerMode`): a stack for each, with each callout."""


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: Any) -> float:
    """Seconds to the first SSE data line; the answer is read whole."""
    started = time.perf_counter()
    first = None
    async with session.post(url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - started
    assert first is not None, "an answer without data"
    return first


async def _drive(
    url: str, rate: float, seconds: float, settings: RequestRateSettings, first: int
) -> list[float]:
    """Requests ``first``, ``first + 1``, ... sent every ``1 / rate`` s for ``seconds``; their TTFTs."""
    count = int(rate * seconds)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            number = first + i
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": _prompt(number, settings.prompt_words)}],
                "max_tokens": settings.output_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            headers = SLO_HEADERS if settings.slo_every and number % settings.slo_every == 0 else None
            tasks.append(asyncio.create_task(_stream(session, url, body, headers)))
        return await asyncio.gather(*tasks)


def ext_proc_messages(stack: LocalStack) -> dict[str, float]:
    """Envoy's ext_proc counters: messages it sent the EPP and received from it, streams."""
    admin = f"http://127.0.0.1:{stack.config.ports.envoy_admin}/stats"
    pattern = r"ext_proc\.(streams_started|stream_msgs_sent|stream_msgs_received)$"
    text = httpx.get(admin, params={"filter": pattern}, timeout=5).text
    counts = dict.fromkeys(("streams_started", "stream_msgs_sent", "stream_msgs_received"), 0.0)
    counts.update(
        (line.split(": ")[0].rsplit(".", 1)[1], float(line.split(": ")[1])) for line in text.splitlines()
    )
    return counts  # all 0 over ext_authz


def _cell(
    stack: LocalStack, url: str, rate: float, settings: RequestRateSettings, idle_rate: float, first: int
) -> dict:
    assert stack.epp is not None and stack.envoy is not None
    epp, envoy = stack.epp.process.pid, stack.envoy.process.pid
    messages_before = ext_proc_messages(stack)
    epp_before, envoy_before, started = task_cpu_seconds(epp), task_cpu_seconds(envoy), time.monotonic()
    ttfts = asyncio.run(_drive(url, rate, settings.seconds, settings, first))
    time.sleep(1.0)  # the last access-log batch
    wall = time.monotonic() - started
    epp_cpu, envoy_cpu = task_cpu_seconds(epp) - epp_before, task_cpu_seconds(envoy) - envoy_before
    messages = ext_proc_messages(stack)
    requests = len(ttfts)
    ttfts.sort()
    return {
        "rate": rate,
        "requests": requests,
        "achieved_rate": requests / (wall - 1.0),
        "epp_us": (epp_cpu - idle_rate * wall) / requests * 1e6,
        "envoy_us": envoy_cpu / requests * 1e6,
        "epp_cores": epp_cpu / wall,
        "messages_to_epp": (messages["stream_msgs_sent"] - messages_before["stream_msgs_sent"]) / len(ttfts),
        "messages_from_epp": (messages["stream_msgs_received"] - messages_before["stream_msgs_received"])
        / len(ttfts),
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(requests - 1, int(0.99 * requests))] * 1e3,
    }


SHARES = {
    "tokenizer": lambda frames: any(
        "epp/tokenizer/model.py" in f or "epp/tokenizer/cache.py" in f for f in frames
    ),
    "event loop, no Python frame (gRPC aio, uvloop I/O)": lambda frames: frames[-1].startswith("Runner.run "),
    "EPP Python (parse, schedule, account, clients)": lambda frames: True,
}
"""Each sampled stack of the main thread goes to the first share whose test it passes."""


def cpu_shares(raw: str) -> dict[str, float]:
    """The share of py-spy's samples of the main thread (``raw``: collapsed stacks, each led by
    its thread) in each of :data:`SHARES`. The threads' own shares come from the kernel
    (:func:`_profile`): py-spy takes a thread waiting in native code (gRPC's poller, the metrics
    server's ``select``) for a busy one."""
    counts = dict.fromkeys(SHARES, 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0]:
            continue
        share = next(name for name, test in SHARES.items() if test(frames))
        counts[share] += int(count)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.items()}


def cpu_by_thread(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of ``pid``, by thread id (nanosecond resolution)."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between the listing and the read
    return seconds


def thread_names(raw: str) -> dict[int, str]:
    """Thread id → name, from the ``thread (TID): NAME`` frames leading py-spy's raw stacks."""
    names = {}
    for line in raw.splitlines():
        head = line.split(";", 1)[0]
        if head.startswith("thread (") and "): " in head:
            tid, name = head[len("thread (") :].split("): ", 1)
            names[int(tid)] = name
    return names


def _profile(stack: LocalStack, url: str, settings: RequestRateSettings, path: Path) -> dict[str, Any]:
    """py-spy's main-thread shares over a pass at the last rate, and each thread's share of the
    EPP's CPU in that pass (the kernel's count; Python names its threads, the kernel does not)."""
    assert stack.epp is not None
    pid = stack.epp.process.pid
    before = cpu_by_thread(pid)
    with flame_graph(pid, path, rate=100, raw=True):
        asyncio.run(_drive(url, settings.rates[-1], settings.seconds, settings, 10_000_000))
    after = cpu_by_thread(pid)
    if not path.is_file():
        return {}
    raw = path.read_text()
    names = thread_names(raw)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    total = sum(used.values()) or 1.0
    threads: dict[str, float] = {}
    for tid, cpu in used.items():
        name = names.get(tid, "native (gRPC core)")
        threads[name] = threads.get(name, 0.0) + cpu / total
    return {"main_thread": cpu_shares(raw), "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]))}


def measure(settings: RequestRateSettings, profile_path: Path | None = None) -> dict[str, Any]:
    """Each callout's cells in turn, on a stack of its own (the cells of the last come last)."""
    runs = [
        _measure_callout(settings, callout, tokenizer, profile_path)
        for callout in settings.callouts
        for tokenizer in settings.tokenizer_sources
    ]
    return {
        "idle_ms_per_s": runs[-1]["idle_ms_per_s"],
        "cells": [cell for run in runs for cell in run["cells"]],
        "cpu_shares": runs[-1]["cpu_shares"],
    }


def _measure_callout(
    settings: RequestRateSettings, callout: Callout, tokenizer: TokenizerMode, profile_path: Path | None
) -> dict[str, Any]:
    sampling = ["--tokenize-every", str(SAMPLE_EVERY)] if tokenizer == "sampled" else []
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            predictors=settings.predictors,
            sim_profile="instant",
            ports=StackPorts.free(),
            epp_args=[*rare_scrape_args(settings.scrape_interval_s), *sampling],
            callout=callout,
            tokenizer_source="estimate" if tokenizer == "estimate" else "dir",
        )
    )
    try:
        stack.start()
        assert stack.epp is not None
        url = f"{stack.gateway_url}/v1/chat/completions"
        asyncio.run(_drive(url, 20.0, 2.0, settings, 1_000_000))  # warm-up; the model's calibration streams
        time.sleep(2.0)
        idle_rate = idle_cpu_rate(stack.epp.process.pid, settings.idle_s)
        cells = [
            {
                "callout": callout,
                "tokenizer": tokenizer,
                **_cell(stack, url, rate, settings, idle_rate, first=i * 100_000),
            }
            for i, rate in enumerate(settings.rates)
        ]
        shares = _profile(stack, url, settings, profile_path) if profile_path else {}
        return {"idle_ms_per_s": idle_rate * 1e3, "cells": cells, "cpu_shares": shares}
    finally:
        stack.stop()


def _markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = [
        [
            c["callout"],
            c["tokenizer"],
            f"{c['rate']:g}",
            f"{c['achieved_rate']:.1f}",
            f"{c['epp_us']:.0f}",
            f"{c['envoy_us']:.0f}",
            f"{c['epp_cores']:.2f}",
            f"{c['messages_to_epp']:.2f} / {c['messages_from_epp']:.2f}",
            f"{c['ttft_p50_ms']:.1f} / {c['ttft_p99_ms']:.1f}",
        ]
        for c in data["cells"]
    ]
    return "\n\n".join(
        [
            "# A request's cost at the rate a replica carries",
            f"Streamed chat answers of {s['output_tokens']} tokens to ~1k-token prompts (each its own, "
            f"one in {s['slo_every']} with SLO headers), open loop for {s['seconds']} s a rate, through "
            f"the `make run` stack ({s['replicas']} simulated replicas on `instant`, predicted-latency, "
            "first-token metering); "
            f"EPP CPU net of its idle rate ({data['idle_ms_per_s']:.1f} ms/s). Load average "
            f"{data['load_before']} before, {data['load_after']} after.",
            markdown_table(
                [
                    "callout",
                    "tokenizer",
                    "rate (req/s)",
                    "achieved",
                    "EPP µs / request",
                    "Envoy µs / request",
                    "EPP cores",
                    "ext_proc messages a request, to / from the EPP",
                    "TTFT p50 / p99 ms",
                ],
                rows,
            ),
            *(_profile_section(data["cpu_shares"], s["rates"][-1]) if data.get("cpu_shares") else []),
        ]
    )


def _profile_section(shares: dict[str, Any], rate: float) -> list[str]:
    return [
        f"Where the EPP's CPU went in a pass at {rate:g} requests/s under py-spy (`epp-profile.txt`): "
        "each thread's share (the kernel's count), then the main thread's by py-spy's samples.",
        markdown_table(
            ["thread", "share of the EPP's CPU"], [[k, f"{v:.1%}"] for k, v in shares["threads"].items()]
        ),
        markdown_table(
            ["main thread", "share of its samples"],
            [[k, f"{v:.1%}"] for k, v in shares["main_thread"].items()],
        ),
    ]


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def run(out_dir: Path, settings: RequestRateSettings | None = None) -> dict[str, Any]:
    settings = settings or RequestRateSettings()
    load_before = _load()
    data: dict[str, Any] = {"machine": machine(), "settings": asdict(settings), "load_before": load_before}
    out_dir.mkdir(parents=True, exist_ok=True)
    data.update(measure(settings, out_dir / "epp-profile.txt" if settings.profile else None))
    data["load_after"] = _load()
    write_results(out_dir, "request_rate", data, _markdown(data))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="50,150")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("results/request_rate"))
    parser.add_argument("--profile", action="store_true", help="then a py-spy pass at the last rate")
    parser.add_argument(
        "--callouts", default="ext-proc,ext-authz", help="how the gateway asks the EPP: a stack for each"
    )
    parser.add_argument(
        "--tokenizer-sources",
        default="dir",
        help="the EPP's tokenizer: dir (the model's), sampled (the model's on one prompt in "
        f"{SAMPLE_EVERY}, calibrated estimates for the rest) or estimate (counts from the text); "
        "a stack for each",
    )
    args = parser.parse_args()
    settings = RequestRateSettings(
        rates=tuple(float(r) for r in args.rates.split(",")),
        seconds=args.seconds,
        profile=args.profile,
        callouts=tuple(args.callouts.split(",")),  # type: ignore[arg-type]
        tokenizer_sources=tuple(args.tokenizer_sources.split(",")),  # type: ignore[arg-type]
    )
    print(json.dumps(run(args.out, settings)["cells"], indent=1))


if __name__ == "__main__":
    main()
