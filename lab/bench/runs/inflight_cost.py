"""Does the EPP's CPU grow with the time a request is in flight, or with what crosses ext_proc?

One request at a time through the live stack (``LocalStack``: simulated replicas with a
realistic decode step, the ``default`` profile's ~6 ms per token, so a long answer takes
seconds), per config:

* **idle**: the EPP's CPU per second with no traffic (its ``/metrics`` scraper);
* **streamed**: a chat completion of ``output_tokens`` tokens (``ignore_eos``) streamed back,
  one SSE event per token, each crossing ext_proc as one response-body message and its reply;
* **buffered**: the same request without streaming: the same seconds in flight, one body.

Each request's EPP CPU is given net of the idle rate over its wall time, then per output token,
per streamed chunk and per second in flight, and split by thread (the event loop, where the
EPP's Python runs, and gRPC's ``event_engine`` thread, which reads and writes the sockets).
With a non-streamed request costing the idle rate only, whatever a streamed one costs more is
per chunk, not per second. A py-spy flame graph (with native frames) of the first streamed
request shows where a chunk's CPU goes.

**bare gRPC**: the floor under a chunk's cost. A servicer that answers every message with the
EPP's continue reply and does nothing else (``bench.harness.grpc_floor``), in its own process, driven
by a gRPC client with the same response-body message, one at a time: back to back, and paced
at a decode step's interval (``pace_ms``) as a streamed answer arrives. Paced, every message wakes an idle
server (gRPC's socket thread, its completion-queue poller, the event loop), so it costs
several times what a message costs back to back.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from bench.harness.flame_graph import flame_graph
from bench.harness.process_cpu import task_cpu_seconds
from bench.runs.live_replay import uses_predictor
from sim.measure.report import machine, markdown_table, write_results
from sim.processes import free_port
from sim.stack import LocalStack, StackConfig, StackPorts


@dataclass
class InflightSettings:
    configs: tuple[str, ...] = ("gie-default", "predicted-latency")
    replicas: int = 2
    predictors: int = 2
    sim_profile: str = "default"
    output_tokens: int = 1500
    repeats: int = 2
    idle_s: float = 10.0
    flame_graphs: bool = True
    bare_messages: int = 1500
    pace_ms: tuple[float, ...] = (0.0, 2.0, 5.0)


def thread_cpu_seconds(pid: int) -> Counter[str]:
    """CPU time of ``pid``'s live threads, summed by thread name (nanosecond resolution)."""
    totals: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            totals[name] += int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between the listing and the read
    return totals


def net_figures(cpu_s: float, wall_s: float, idle_rate: float, tokens: int, chunks: int) -> dict[str, float]:
    """One request's EPP CPU net of the idle rate over its wall time, per token, chunk and second."""
    net = cpu_s - idle_rate * wall_s
    return {
        "cpu_ms": cpu_s * 1e3,
        "net_ms": net * 1e3,
        "net_us_per_token": net / tokens * 1e6 if tokens else 0.0,
        "net_us_per_chunk": net / chunks * 1e6 if chunks else 0.0,
        "net_ms_per_s_in_flight": net / wall_s * 1e3 if wall_s else 0.0,
    }


def _request(client: httpx.Client, url: str, body: dict[str, Any], stream: bool) -> tuple[int, int]:
    """Send one chat completion; return (completion tokens, SSE data events)."""
    if not stream:
        response = client.post(url, json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"], 0
    chunks = 0
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            chunks += line.startswith("data: ") and line != "data: [DONE]"
    return body["max_tokens"], chunks


def _measure_one(
    pid: int, client: httpx.Client, url: str, body: dict[str, Any], stream: bool, idle_rate: float
) -> dict[str, Any]:
    threads_before, before, started = thread_cpu_seconds(pid), task_cpu_seconds(pid), time.monotonic()
    tokens, chunks = _request(client, url, body, stream)
    wall, cpu = time.monotonic() - started, task_cpu_seconds(pid) - before
    threads = thread_cpu_seconds(pid)
    threads.subtract(threads_before)
    return {
        "stream": stream,
        "wall_s": wall,
        "tokens": tokens,
        "chunks": chunks,
        **net_figures(cpu, wall, idle_rate, tokens, chunks),
        "threads_ms": {name: round(s * 1e3, 1) for name, s in threads.most_common() if s > 1e-3},
    }


def _measure(config: str, settings: InflightSettings, out_dir: Path) -> dict[str, Any]:
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            ports=StackPorts.free(),
            sim_profile=settings.sim_profile,
            epp_config=config,
            predictors=settings.predictors if uses_predictor(config) else 0,
            epp_args=["--log-level", "WARNING"],
        )
    )
    try:
        stack.start()
        assert stack.epp is not None
        pid = stack.epp.process.pid
        url = f"{stack.gateway_url}/v1/chat/completions"
        body = {
            "model": stack.config.model,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": settings.output_tokens,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=300) as client:
            for _ in range(3):  # warm-up: connections, tokenizer, first scrape
                _request(client, url, {**body, "max_tokens": 16}, stream=True)
            before = task_cpu_seconds(pid)
            time.sleep(settings.idle_s)
            idle_rate = (task_cpu_seconds(pid) - before) / settings.idle_s
            requests = []
            flame = out_dir / f"inflight-{config}-streamed.svg" if settings.flame_graphs else None
            with flame_graph(pid, flame, rate=200, native=True):
                profiled = _measure_one(pid, client, url, body, True, idle_rate)
            for _ in range(settings.repeats):
                requests.append(_measure_one(pid, client, url, body, True, idle_rate))
                requests.append(_measure_one(pid, client, url, body, False, idle_rate))
        idle_ms_per_s = idle_rate * 1e3
        return {"config": config, "idle_ms_per_s": idle_ms_per_s, "requests": requests, "profiled": profiled}
    finally:
        stack.stop()


async def _drive(port: int, messages: int, pace_s: float) -> None:
    event = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'
    message = ProcessingRequest(response_body=HttpBody(body=event))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)  # the server is starting
        call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
        for _ in range(messages):
            await call.write(message)
            await call.read()
            if pace_s:
                await asyncio.sleep(pace_s)
        await call.done_writing()


def measure_bare_grpc(settings: InflightSettings) -> list[dict[str, float]]:
    """Server CPU per message of the bare servicer, at each pace (its idle CPU is ~0)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.harness.grpc_floor", "--port", str(port)])
    try:
        uvloop.run(_drive(port, 50, 0.0))  # warm-up, once the server answers
        rows = []
        for pace_ms in settings.pace_ms:
            before, started = task_cpu_seconds(server.pid), time.monotonic()
            uvloop.run(_drive(port, settings.bare_messages, pace_ms / 1e3))
            wall, cpu = time.monotonic() - started, task_cpu_seconds(server.pid) - before
            rows.append(
                {"pace_ms": pace_ms, "wall_s": wall, "us_per_message": cpu / settings.bare_messages * 1e6}
            )
        return rows
    finally:
        server.terminate()
        server.wait(10)


def _markdown(data: dict[str, Any]) -> str:
    rows = [
        [
            r["config"],
            "streamed" if q["stream"] else "buffered",
            f"{q['wall_s']:.2f}",
            q["chunks"],
            f"{q['cpu_ms']:.0f}",
            f"{q['net_ms']:.0f}",
            f"{q['net_us_per_chunk']:.0f}" if q["chunks"] else "-",
            f"{q['net_ms_per_s_in_flight']:.1f}",
            ", ".join(f"{k} {v:.0f}" for k, v in q["threads_ms"].items()),
        ]
        for r in data["results"]
        for q in r["requests"]
    ]
    idle = ", ".join(f"{r['config']} {r['idle_ms_per_s']:.1f}" for r in data["results"])
    headers = ["config", "response", "wall s", "chunks", "EPP CPU ms", "net of idle ms", "net µs/chunk"]
    headers += ["net ms per s in flight", "threads ms"]
    return "\n\n".join(
        [
            "# EPP CPU against time in flight",
            f"One request at a time, {data['settings']['output_tokens']} output tokens, simulated "
            f"replicas with the `{data['settings']['sim_profile']}` profile. Idle EPP CPU (ms/s): {idle}.",
            markdown_table(headers, rows),
            "Bare gRPC servicer (continue replies only, its own process), server CPU per message:",
            markdown_table(
                ["pace ms", "wall s", "µs per message"],
                [
                    [b["pace_ms"], f"{b['wall_s']:.2f}", f"{b['us_per_message']:.0f}"]
                    for b in data["bare_grpc"]
                ],
            ),
            "Flame graphs (py-spy, native frames) of one streamed request: `inflight-<config>-streamed.svg`"
            " (py-spy's sampling inflates that request's CPU, so it is left out of the table).",
        ]
    )


def run(out_dir: Path, settings: InflightSettings | None = None) -> dict[str, Any]:
    settings = settings or InflightSettings()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [_measure(config, settings, out_dir) for config in settings.configs]
    bare = measure_bare_grpc(settings)
    data = {"machine": machine(), "settings": settings.__dict__, "results": results, "bare_grpc": bare}
    write_results(out_dir, "inflight", data, _markdown(data))
    return data
