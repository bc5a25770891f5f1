"""EPP overhead: the same requests through Envoy with and without the EPP, on this machine.

Two arms share one set of upstreams and run in alternating rounds so that drift affects both:

* **with EPP**: Envoy → ext_proc (request headers, buffered body, response headers; the body
  of a streamed response too) → the pick → upstream;
* **without EPP**: Envoy → round-robin upstream, no ext_proc filter.

Upstreams are stub engines (Envoy direct responses), so what differs between the arms is the
EPP alone. Reported per endpoint count and concurrency: requests/s, p50/p99 latency, the
latency the EPP adds, and the EPP's CPU time per request. A second phase streams 256-token
responses from the simulated engine and reports the EPP's CPU time per streamed request
(every response chunk crosses ext_proc), net of its idle scraping cost.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.progress import Progress

from bench.harness.loadgen import LoadResult, closed_loop
from bench.harness.rig import GatewayRig
from sim.measure.report import machine, markdown_table, write_results

SHORT_REQUEST = json.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 1}).encode()


@dataclass
class OverheadSettings:
    endpoint_counts: tuple[int, ...] = (4, 64)
    concurrencies: tuple[int, ...] = (1, 16)
    rounds: int = 3
    round_s: float = 4.0
    stream_requests: int = 200
    stream_tokens: int = 256
    stream_concurrency: int = 8


def _arm(rig: GatewayRig, with_epp: bool, concurrency: int, seconds: float) -> tuple[LoadResult, float]:
    url = (rig.with_epp_url if with_epp else rig.without_epp_url) + "/v1/completions"
    assert rig.epp is not None
    cpu_before = rig.epp.cpu_seconds()
    result = asyncio.run(closed_loop(url, SHORT_REQUEST, concurrency=concurrency, duration_s=seconds))
    return result, rig.epp.cpu_seconds() - cpu_before


def measure_overhead(settings: OverheadSettings, progress: Progress) -> list[dict[str, Any]]:
    cases = []
    steps = len(settings.endpoint_counts) * len(settings.concurrencies) * settings.rounds
    task = progress.add_task("EPP overhead (stub engines)", total=steps)
    for n in settings.endpoint_counts:
        with GatewayRig(endpoints=n) as rig:
            for c in settings.concurrencies:
                arms = {True: LoadResult(), False: LoadResult()}
                epp_cpu = {True: 0.0, False: 0.0}
                for _ in range(settings.rounds):
                    for with_epp in (False, True):
                        result, cpu = _arm(rig, with_epp, c, settings.round_s)
                        arms[with_epp] = arms[with_epp].merge(result)
                        epp_cpu[with_epp] += cpu
                    progress.advance(task)
                a, b = arms[True], arms[False]
                idle_cpu_per_s = epp_cpu[False] / b.duration_s  # scraping, with no requests through the EPP
                net_cpu = epp_cpu[True] - idle_cpu_per_s * a.duration_s
                cases.append(
                    {
                        "endpoints": n,
                        "concurrency": c,
                        "with_epp": a.summary(),
                        "without_epp": b.summary(),
                        "added_p50_ms": round(a.percentile_ms(50) - b.percentile_ms(50), 3),
                        "added_p99_ms": round(a.percentile_ms(99) - b.percentile_ms(99), 3),
                        "epp_cpu_ms_per_request": round(net_cpu / max(1, a.requests) * 1e3, 3),
                        "epp_idle_cpu_percent": round(idle_cpu_per_s * 100, 1),
                    }
                )
    return cases


async def _streamed(url: str, body: bytes, requests: int, concurrency: int) -> int:
    done = 0
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal done
            while done < requests:
                done += 1
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def measure_streaming_cpu(settings: OverheadSettings, progress: Progress) -> dict[str, Any]:
    task = progress.add_task("EPP CPU per streamed response (simulated engines)", total=2)
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": settings.stream_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    with GatewayRig(endpoints=4, engine="instant") as rig:
        assert rig.epp is not None
        idle_start, idle_cpu = time.perf_counter(), rig.epp.cpu_seconds()
        time.sleep(3.0)
        idle_rate = (rig.epp.cpu_seconds() - idle_cpu) / (time.perf_counter() - idle_start)
        progress.advance(task)
        start, cpu = time.perf_counter(), rig.epp.cpu_seconds()
        n = asyncio.run(
            _streamed(
                rig.with_epp_url + "/v1/completions",
                body,
                settings.stream_requests,
                settings.stream_concurrency,
            )
        )
        elapsed, used = time.perf_counter() - start, rig.epp.cpu_seconds() - cpu
        progress.advance(task)
    net = used - idle_rate * elapsed
    return {
        "requests": n,
        "tokens_per_response": settings.stream_tokens,
        "epp_cpu_ms_per_request": round(net / n * 1e3, 3),
        "epp_cpu_us_per_token": round(net / (n * settings.stream_tokens) * 1e6, 2),
        "epp_idle_cpu_percent": round(idle_rate * 100, 1),
        "wall_s": round(elapsed, 2),
    }


def _plot(cases: list[dict[str, Any]], path: Path) -> None:
    labels = [f"{c['endpoints']} ep\nc={c['concurrency']}" for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(cases))
    for ax, stat in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        ax.bar([i - 0.2 for i in x], [c["without_epp"][stat] for c in cases], 0.4, label="Envoy only")
        ax.bar([i + 0.2 for i in x], [c["with_epp"][stat] for c in cases], 0.4, label="Envoy + EPP")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(f"latency {stat.split('_')[0]} (ms)")
        ax.legend()
    fig.suptitle("Request latency through the gateway, with and without the EPP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(data: dict[str, Any]) -> str:
    rows = [
        [
            c["endpoints"],
            c["concurrency"],
            c["without_epp"]["rps"],
            c["with_epp"]["rps"],
            c["without_epp"]["p50_ms"],
            c["with_epp"]["p50_ms"],
            c["added_p50_ms"],
            c["without_epp"]["p99_ms"],
            c["with_epp"]["p99_ms"],
            c["added_p99_ms"],
            c["epp_cpu_ms_per_request"],
        ]
        for c in data["cases"]
    ]
    table = markdown_table(
        [
            "endpoints",
            "concurrency",
            "rps w/o EPP",
            "rps with EPP",
            "p50 w/o",
            "p50 with",
            "added p50 ms",
            "p99 w/o",
            "p99 with",
            "added p99 ms",
            "EPP CPU ms/req",
        ],
        rows,
    )
    s = data["streaming"]
    m = data["machine"]
    return "\n\n".join(
        [
            "# EPP overhead",
            f"Machine: {m['cpus']} CPUs, Python {m['python']}, Envoy {m['envoy']}, {m['date']}. "
            "Everything (load generator, 2-3 Envoys, EPP, engines) shares these CPUs.",
            "## Short non-streamed requests (stub engines)",
            table,
            "![latency](overhead.png)",
            "## Streamed responses (simulated engines)",
            f"{s['requests']} streamed completions of {s['tokens_per_response']} tokens: EPP CPU "
            f"**{s['epp_cpu_ms_per_request']} ms per request** ({s['epp_cpu_us_per_token']} µs per token), "
            f"net of idle scraping ({s['epp_idle_cpu_percent']}% of a core).",
        ]
    )


def run(out_dir: Path, settings: OverheadSettings | None = None) -> dict[str, Any]:
    settings = settings or OverheadSettings()
    with Progress() as progress:
        data = {
            "machine": machine(),
            "settings": settings.__dict__,
            "cases": measure_overhead(settings, progress),
            "streaming": measure_streaming_cpu(settings, progress),
        }
    write_results(out_dir, "overhead", data, _markdown(data))
    _plot(data["cases"], out_dir / "overhead.png")
    return data
