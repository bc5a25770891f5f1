"""The EPP's CPU per second with no traffic, against the pool's size.

With no request in flight the EPP's work is its ``/metrics`` scraper's, one poller per
endpoint, so this is what the pool's size costs. The engines are stub engines (one Envoy
process, one listener per endpoint, ``bench.harness.stub_engine``) answering a real vLLM 0.32 scrape
(``tests/fixtures/vllm-0.32/metrics_full.txt``, 55 KB) and ``/v1/models``, so that hundreds of
endpoints fit on a small machine; the EPP is the real process, fed the endpoints by a static
file. Per pool size and arm, the EPP's CPU (all its threads, ``/proc``) is read over ``idle_s``
after ``settle_s`` of start-up:

* **idle tick**: the EPP's defaults (idle endpoints scraped every ``--idle-scrape-interval-s``);
* **fast tick**: every endpoint scraped every 50 ms, as before the idle tick
  (``--idle-scrape-interval-s 0.05``).

The load average before each reading goes in the results: other work on the machine's cores
inflates the figures.

**Under load** the idle tick must not make the view staler: per arm, ``loaded_endpoints`` stub
engines behind Envoy get ``loaded_rate`` requests a second through the EPP (one at a time,
evenly spaced), and the EPP's ``llm_epp_endpoint_metrics_age_seconds`` of every endpoint is
sampled every 100 ms for ``idle_s``: the scrapes' age as a decision would see it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib.pyplot as plt

from bench.harness.process_cpu import task_cpu_seconds
from bench.harness.rig import GatewayRig
from bench.harness.stub_engine import stub_engine_bootstrap
from sim.measure.prometheus_samples import scrape
from sim.measure.report import machine, markdown_table, save_figure, write_results
from sim.models import TINY_MODEL_DIR
from sim.processes import Component, free_port, start_envoy, start_epp, write_endpoints_file

VLLM_SCRAPE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "vllm-0.32" / "metrics_full.txt"
ARMS: dict[str, tuple[str, ...]] = {
    "idle tick": (),
    "fast tick": ("--idle-scrape-interval-s", "0.05"),
}
"""Each arm's EPP flags."""


@dataclass
class IdleSettings:
    pool_sizes: tuple[int, ...] = (4, 100)
    idle_s: float = 10.0
    settle_s: float = 3.0
    loaded_endpoints: int = 4
    loaded_rate: float = 40.0


def ms_per_s(cpu_before_s: float, cpu_after_s: float, wall_s: float) -> float:
    """CPU milliseconds per wall second between two readings of a process's CPU seconds."""
    return (cpu_after_s - cpu_before_s) * 1e3 / wall_s


def _measure(endpoints: int, flags: tuple[str, ...], settings: IdleSettings, workdir: Path) -> dict[str, Any]:
    """Start ``endpoints`` stub engines and the EPP with ``flags``; its idle CPU rate."""
    ports = [free_port() for _ in range(endpoints)]
    components: list[Component] = []
    try:
        components.append(
            start_envoy(
                "stub-engines", stub_engine_bootstrap(ports, VLLM_SCRAPE.read_text()), workdir, concurrency=1
            )
        )
        epp = start_epp(
            workdir,
            write_endpoints_file(workdir / "endpoints.yaml", [("127.0.0.1", p) for p in ports]),
            grpc_port=free_port(),
            health_port=free_port(),
            metrics_port=free_port(),
            expected_endpoints=endpoints,
            tokenizer=TINY_MODEL_DIR,
            extra_args=["--log-level", "WARNING", *flags],
        )
        components.append(epp)
        time.sleep(settings.settle_s)
        load_1m = os.getloadavg()[0]
        pid = epp.process.pid
        before, started = task_cpu_seconds(pid), time.monotonic()
        time.sleep(settings.idle_s)
        rate = ms_per_s(before, task_cpu_seconds(pid), time.monotonic() - started)
    finally:
        for component in reversed(components):
            component.stop()
    return {"endpoints": endpoints, "ms_per_s": round(rate, 1), "load_1m_before": round(load_1m, 2)}


def age_summary(ages_s: list[float]) -> dict[str, float]:
    """Mean, p99 and largest of sampled scrape ages, in milliseconds."""
    ordered = sorted(ages_s)
    return {
        "mean_ms": round(sum(ordered) * 1e3 / len(ordered), 1),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 1),
        "max_ms": round(ordered[-1] * 1e3, 1),
    }


def _send(url: str, rate: float, stop: threading.Event) -> None:
    """One short completion after another, ``rate`` a second, until ``stop``."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
    with httpx.Client(timeout=10) as client:
        due = time.monotonic()
        while not stop.is_set():
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
            due += 1 / rate
            time.sleep(max(0.0, due - time.monotonic()))


def _scrape_ages_under_load(flags: tuple[str, ...], settings: IdleSettings) -> dict[str, Any]:
    with GatewayRig(settings.loaded_endpoints, epp_args=list(flags)) as rig:
        stop = threading.Event()
        sender = threading.Thread(target=_send, args=(rig.with_epp_url, settings.loaded_rate, stop))
        sender.start()
        try:
            time.sleep(settings.settle_s)
            ages: list[float] = []
            end = time.monotonic() + settings.idle_s
            while time.monotonic() < end:
                samples = scrape(f"http://127.0.0.1:{rig.epp_metrics_port}/metrics")
                ages += [
                    v for (name, _), v in samples.items() if name == "llm_epp_endpoint_metrics_age_seconds"
                ]
                time.sleep(0.1)
        finally:
            stop.set()
            sender.join()
    return {"endpoints": settings.loaded_endpoints, "samples": len(ages), **age_summary(ages)}


def _markdown(data: dict[str, Any]) -> str:
    settings = data["settings"]
    rows = [
        [r["arm"], r["endpoints"], f"{r['ms_per_s']:.1f}", f"{r['load_1m_before']:.2f}"]
        for r in data["results"]
    ]
    return "\n\n".join(
        [
            "# EPP CPU with no traffic, against the pool's size",
            f"Stub engines serving a 55 KB vLLM scrape; EPP CPU over {settings['idle_s']:g} s after "
            f"{settings['settle_s']:g} s of start-up. Machine: {data['machine']['cpus']} CPUs, "
            f"{data['machine']['date']}.",
            markdown_table(["arm", "endpoints", "EPP CPU (ms/s)", "load average (1 min) before"], rows),
            "![EPP idle CPU](idle.png)",
            f"Scrape age under load: {settings['loaded_rate']:g} requests/s through Envoy and the EPP to "
            f"{settings['loaded_endpoints']} stub engines, every endpoint's age sampled every 100 ms.",
            markdown_table(
                ["arm", "samples", "mean (ms)", "p99 (ms)", "max (ms)"],
                [[r["arm"], r["samples"], r["mean_ms"], r["p99_ms"], r["max_ms"]] for r in data["loaded"]],
            ),
        ]
    )


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    figure, axis = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        points = [(r["endpoints"], r["ms_per_s"]) for r in data["results"] if r["arm"] == arm]
        axis.plot(*zip(*points, strict=True), marker="o", label=arm)
    axis.set_xlabel("endpoints in the pool")
    axis.set_ylabel("EPP CPU with no traffic (ms/s)")
    axis.grid(alpha=0.3)
    axis.legend()
    return save_figure(figure, out_dir, "idle.png")


def run(out_dir: Path, settings: IdleSettings | None = None) -> dict[str, Any]:
    settings = settings or IdleSettings()
    results = []
    for endpoints in settings.pool_sizes:
        for arm, flags in ARMS.items():
            with tempfile.TemporaryDirectory(prefix="llm-epp-idle-") as workdir:
                measured = _measure(endpoints, flags, settings, Path(workdir))
            results.append({"arm": arm, **measured})
            print(f"{arm}, {endpoints} endpoints: {measured['ms_per_s']:.1f} ms/s", flush=True)
    loaded = []
    for arm, flags in ARMS.items():
        loaded.append({"arm": arm, **_scrape_ages_under_load(flags, settings)})
        print(f"{arm}, under load: {loaded[-1]}", flush=True)
    data = {"machine": machine(), "settings": asdict(settings), "results": results, "loaded": loaded}
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(data, out_dir)
    write_results(out_dir, "idle", data, _markdown(data))
    return data
