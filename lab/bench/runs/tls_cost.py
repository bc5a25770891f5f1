"""What TLS on ext_proc costs: the live stack (real Envoy, the EPP with ``gie-default``,
simulated replicas with the ``instant`` profile) with plaintext, TLS and mTLS between Envoy and
the EPP, side by side.

The three stacks run at once and are measured in interleaved rounds (plaintext, TLS, mTLS, then
again), so drift in a shared machine's load falls on all three alike. For each mode and
concurrency: p50/p99 latency through the gateway and the EPP's CPU per request, its idle CPU
(scraping) measured just before each round and subtracted. Envoy keeps its HTTP/2 connection
to the EPP open, so the handshake is paid once per connection and what a request pays is the
encryption of its ext_proc messages (headers, the request body, response headers and body
chunks), on both sides.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.loadgen import LoadResult, closed_loop
from bench.harness.process_cpu import task_cpu_seconds
from bench.runs.stack_overhead import SHORT_PROMPT
from sim.measure.report import machine, markdown_table, write_results
from sim.stack import LocalStack, StackConfig, StackPorts, TlsMode

MODES: tuple[TlsMode, ...] = ("off", "tls", "mtls")


@dataclass
class TlsCostSettings:
    replicas: int = 2
    concurrencies: tuple[int, ...] = (1, 8)
    rounds: int = 5
    seconds: float = 5.0
    idle_s: float = 1.0


def _stack(mode: TlsMode, settings: TlsCostSettings) -> LocalStack:
    return LocalStack(
        StackConfig(
            replicas=settings.replicas,
            ports=StackPorts.free(),
            sim_profile="instant",
            epp_config="gie-default",
            tls=mode,
            epp_args=["--log-level", "WARNING"],
        )
    )


def _round(
    stack: LocalStack, body: bytes, concurrency: int, settings: TlsCostSettings
) -> tuple[LoadResult, float]:
    """One measured window: its load result and the EPP's CPU seconds beyond its idle rate."""
    assert stack.epp is not None
    pid = stack.epp.process.pid
    idle_start = task_cpu_seconds(pid)
    time.sleep(settings.idle_s)
    idle_rate = (task_cpu_seconds(pid) - idle_start) / settings.idle_s
    before, started = task_cpu_seconds(pid), time.perf_counter()
    url = stack.gateway_url + "/v1/completions"
    result = asyncio.run(closed_loop(url, body, concurrency=concurrency, duration_s=settings.seconds))
    elapsed = time.perf_counter() - started
    return result, task_cpu_seconds(pid) - before - idle_rate * elapsed


def measure(settings: TlsCostSettings) -> list[dict[str, Any]]:
    body = json.dumps({"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 1}).encode()
    cases = []
    with ExitStack() as stacks:
        running = {}
        for mode in MODES:
            stack = _stack(mode, settings)
            stacks.callback(stack.stop)
            stack.start()
            running[mode] = stack
        for concurrency in settings.concurrencies:
            loads = {mode: LoadResult() for mode in MODES}
            cpu = {mode: 0.0 for mode in MODES}
            for _ in range(settings.rounds):
                for mode, stack in running.items():
                    result, seconds = _round(stack, body, concurrency, settings)
                    loads[mode] = loads[mode].merge(result)
                    cpu[mode] += seconds
            for mode in MODES:
                load = loads[mode]
                assert set(load.statuses) == {200}, f"{mode}: {dict(load.statuses)}"
                cases.append(
                    {
                        "mode": mode,
                        "concurrency": concurrency,
                        **load.summary(),
                        "p50_ms": round(load.percentile_ms(50), 3),
                        "p99_ms": round(load.percentile_ms(99), 3),
                        "epp_cpu_ms_per_request": round(cpu[mode] / max(1, load.requests) * 1e3, 3),
                    }
                )
    return cases


def _added(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency and mode, what it adds over plaintext."""
    plain = {c["concurrency"]: c for c in cases if c["mode"] == "off"}
    return [
        {
            "mode": c["mode"],
            "concurrency": c["concurrency"],
            "added_p50_ms": round(c["p50_ms"] - plain[c["concurrency"]]["p50_ms"], 3),
            "added_epp_cpu_ms_per_request": round(
                c["epp_cpu_ms_per_request"] - plain[c["concurrency"]]["epp_cpu_ms_per_request"], 3
            ),
        }
        for c in cases
        if c["mode"] != "off"
    ]


def _markdown(data: dict[str, Any]) -> str:
    rows = [
        [c["mode"], c["concurrency"], c["requests"], c["p50_ms"], c["p99_ms"], c["epp_cpu_ms_per_request"]]
        for c in data["cases"]
    ]
    added = [
        [a["mode"], a["concurrency"], a["added_p50_ms"], a["added_epp_cpu_ms_per_request"]]
        for a in data["added"]
    ]
    return "\n\n".join(
        [
            "# ext_proc TLS cost",
            f"Machine: {data['machine']}. Settings: {data['settings']}.",
            markdown_table(["mode", "concurrency", "requests", "p50 ms", "p99 ms", "EPP CPU ms/req"], rows),
            "Over plaintext:",
            markdown_table(["mode", "concurrency", "added p50 ms", "added EPP CPU ms/req"], added),
        ]
    )


def run(out_dir: Path, settings: TlsCostSettings | None = None) -> dict[str, Any]:
    settings = settings or TlsCostSettings()
    cases = measure(settings)
    data = {"machine": machine(), "settings": settings.__dict__, "cases": cases, "added": _added(cases)}
    write_results(out_dir, "tls-cost", data, _markdown(data))
    return data
