"""``llm-epp-bench sync``: what active-active EPP replicas cost and carry, measured live.

* **Sync lag** through a real nats-server on loopback: one replica books requests at a fixed
  rate (100 and 1,000 requests/s; each is released 0.5 s later) through the real
  ``ReplicaSyncState`` and ``NatsSyncTransport``; a second replica applies them. Two lags, p50
  and p99: publish → apply per message (what ``llm_epp_sync_lag_seconds`` shows), and routed →
  booked on the peer per request (also the wait for the publish loop to wake and, for a request
  whose endpoint already went out at once this sync tick, for the tick). Both replicas
  run in this one process and event loop, so the receiver's lag includes the sender's work.
* **Throughput through Envoy** with one EPP process and with two synced ones, in the same run:
  a closed loop of short completions (1 output token, ``instant`` simulated engines) at
  concurrency 16, requests/s and CPU per request of every process; from the CPU per request,
  the throughput ceiling on this machine's cores and on one core more.

Kill, cancellation and NATS-outage behaviour is measured by ``llm-epp-bench sync-failures``
(lab/bench/runs/sync_failures.py) and asserted by tests/integration/test_epp_replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from prometheus_client import CollectorRegistry

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.harness.loadgen import closed_loop
from epp.datalayer.endpoints import EndpointStore
from epp.load.peer_totals import PeerTotals, unpack_tail_rows
from epp.sync.messages import MessageKind
from epp.sync.metrics import SyncMetrics
from epp.sync.nats_transport import NatsSyncTransport
from epp.sync.state import ReplicaSyncState, SyncTargets
from sim.measure.report import machine, markdown_table, save_figure, write_results
from sim.nats_server import start_nats_server
from sim.processes import Component, free_port
from sim.stack import LocalStack, StackConfig, StackPorts

SUBJECT_ROOT = "llm-epp-bench.pool"
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(8)]
SHORT_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10


@dataclass
class SyncBenchSettings:
    rates: tuple[float, ...] = (100.0, 1000.0)
    lag_duration_s: float = 5.0
    hold_s: float = 0.5
    """How long each booked request stays in flight before it is released."""
    load_s: float = 8.0
    idle_s: float = 3.0
    """Idle time before the load, to tell each process's background CPU from its per-request CPU."""
    concurrency: int = 16
    engines: int = 2


class _RecordingTotals(PeerTotals):
    """The peer's token load, noting when each booking first showed in it (the sender's key,
    which the bench sends as the booking's prompt tail → perf_counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.booked_at: dict[int, float] = {}

    def replace(self, peer, endpoint, counts, tails=b"") -> None:  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        for key in unpack_tail_rows(tails)[:, 0].tolist():
            self.booked_at.setdefault(key, now)
        super().replace(peer, endpoint, counts, tails)


def _replica(name: str, url: str, tracker: PeerTotals) -> NatsSyncTransport:
    state = ReplicaSyncState(
        name, SyncTargets(token_load=tracker), clock=time.monotonic, wall_clock=time.time
    )
    metrics = SyncMetrics(CollectorRegistry(), "pool", EndpointStore(), state, None)
    return NatsSyncTransport(state, [url], SUBJECT_ROOT, metrics=metrics)


def _ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else float("nan")


async def _lag_at(url: str, rate: float, settings: SyncBenchSettings) -> dict[str, Any]:
    peer_load = _RecordingTotals()
    sender, receiver = _replica("bench-a", url, PeerTotals()), _replica("bench-b", url, peer_load)
    message_lags: list[float] = []
    receive = receiver.state.receive

    def recording_receive(data: bytes):  # type: ignore[no-untyped-def]
        received = receive(data)
        if received is not None and received.kind == MessageKind.DELTAS:
            message_lags.append(received.lag_s)
        return received

    receiver.state.receive = recording_receive  # type: ignore[method-assign]
    await sender.start()
    await receiver.start()
    routed_at: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 10
        while not (sender.connected and receiver.connected and "bench-a" in receiver.state.peers):
            assert time.monotonic() < deadline, "the replicas did not meet through NATS"
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        start, key = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - start) < settings.lag_duration_s:
            for _ in range(int(elapsed * rate) - key):  # catch up with the schedule
                routed_at[key] = time.perf_counter()
                sender.state.routed(
                    key,
                    ENDPOINTS[key % len(ENDPOINTS)],
                    kv_tokens=900,
                    uncached_tokens=300,
                    expected_output=200,
                    prompt_tail=key,
                )
                loop.call_later(settings.hold_s, sender.state.released, key)
                key += 1
            await asyncio.sleep(min(0.01, 1 / rate))
        await asyncio.sleep(settings.hold_s + 1)
    finally:
        await sender.close()
        await receiver.close()
    booked = [peer_load.booked_at[k] - t for k, t in routed_at.items() if k in peer_load.booked_at]
    return {
        "rate": rate,
        "requests": len(routed_at),
        "booked_on_peer": len(booked),
        "messages": len(message_lags),
        "publish_to_apply_p50_ms": _ms(message_lags, 50),
        "publish_to_apply_p99_ms": _ms(message_lags, 99),
        "routed_to_booked_p50_ms": _ms(booked, 50),
        "routed_to_booked_p99_ms": _ms(booked, 99),
        "peer_load_left": sum(peer_load.load(e).kv_tokens for e in ENDPOINTS),
    }


def measure_lag(settings: SyncBenchSettings, workdir: Path) -> list[dict[str, Any]]:
    port = free_port()
    server = start_nats_server(workdir, port)
    try:
        return [asyncio.run(_lag_at(f"nats://127.0.0.1:{port}", r, settings)) for r in settings.rates]
    finally:
        server.stop()


def measure_throughput(epp_replicas: int, settings: SyncBenchSettings, workdir: Path) -> dict[str, Any]:
    config = StackConfig(
        replicas=settings.engines,
        sim_profile="instant",
        ports=StackPorts.free(),
        workdir=workdir,
        epp_replicas=epp_replicas,
    )
    stack = LocalStack(config)
    stack.start()
    try:
        processes = {c.name: c for c in stack.components()}
        body = json.dumps({"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 1}).encode()
        url = f"{stack.gateway_url}/v1/completions"
        asyncio.run(closed_loop(url, body, concurrency=settings.concurrency, duration_s=1.0))  # warm-up
        idle = _cpu_over(processes, lambda: time.sleep(settings.idle_s))
        load = closed_loop(url, body, concurrency=settings.concurrency, duration_s=settings.load_s)
        result = None

        def run_load() -> None:
            nonlocal result
            result = asyncio.run(load)

        busy = _cpu_over(processes, run_load)
    finally:
        stack.stop()
    assert result is not None
    idle_cores = {name: s / settings.idle_s for name, s in idle.items()}
    # Background work (engine scrapes, heartbeats) is paid per second, not per request.
    net = {name: max(0.0, s - idle_cores[name] * result.duration_s) for name, s in busy.items()}
    return {
        "epp_processes": epp_replicas,
        **result.summary(),
        "cpu_ms_per_request": {name: round(s / max(1, result.requests) * 1e3, 3) for name, s in net.items()},
        "idle_cores": {name: round(c, 3) for name, c in idle_cores.items()},
        "cpu_utilisation": {name: round(s / result.duration_s, 2) for name, s in busy.items()},
    }


def _cpu_over(processes: dict[str, Component], action: Callable[[], None]) -> dict[str, float]:
    """CPU seconds each process used while ``action`` ran."""
    before = {name: c.cpu_seconds() for name, c in processes.items()}
    action()
    return {name: c.cpu_seconds() - before[name] for name, c in processes.items()}


def ceilings(run: dict[str, Any], cores: int) -> dict[str, float]:
    """Requests/s this configuration could reach from its CPU per request (ms of each process per
    request served by the whole stack, past its idle use): all processes share the cores left
    after their idle use, and each EPP process, one Python thread, also stops where its own
    share reaches one core."""
    per_request, idle = run["cpu_ms_per_request"], run["idle_cores"]
    total, idle_total = sum(per_request.values()), sum(idle.values())
    epps = [k for k in per_request if k.startswith("epp")]
    epp_bound = min((1 - idle[k]) * 1e3 / per_request[k] for k in epps)
    return {
        f"{n}_cores_rps": round(min((n - idle_total) * 1e3 / total, epp_bound), 1) for n in (cores, cores + 1)
    }


def _markdown(data: dict[str, Any]) -> str:
    lag_rows = [
        [r["rate"], r["requests"], r["booked_on_peer"], r["publish_to_apply_p50_ms"],
         r["publish_to_apply_p99_ms"], r["routed_to_booked_p50_ms"], r["routed_to_booked_p99_ms"],
         r["peer_load_left"]]
        for r in data["lag"]
    ]  # fmt: skip
    tp_rows = []
    for run in data["throughput"]:
        cpu = ", ".join(f"{k} {v}" for k, v in run["cpu_ms_per_request"].items())
        idle = ", ".join(f"{k} {v}" for k, v in run["idle_cores"].items())
        c = run["ceilings"]
        tp_rows.append(
            [run["epp_processes"], run["rps"], run["p50_ms"], run["p99_ms"], run["statuses"], cpu, idle,
             *c.values()]
        )  # fmt: skip
    cores = data["machine"]["cpus"]
    return "\n\n".join(
        [
            "# Active-active EPP sync, live",
            f"Machine: {data['machine']['cpus']} CPUs, load average {data['load_average']} at the start, "
            f"{data['load_average_end']} at the end. Command: `{data['command']}`.",
            "## Sync lag through nats-server on loopback",
            markdown_table(
                [
                    "requests/s",
                    "requests",
                    "booked on peer",
                    "publish→apply p50 ms",
                    "p99 ms",
                    "routed→booked p50 ms",
                    "p99 ms",
                    "peer KV tokens left after release",
                ],
                lag_rows,
            ),
            "## Requests/s through Envoy, one EPP process and two",
            markdown_table(
                [
                    "EPPs",
                    "requests/s",
                    "p50 ms",
                    "p99 ms",
                    "statuses",
                    "CPU ms per request (past idle)",
                    "idle CPU (cores)",
                    f"ceiling on {cores} cores",
                    f"ceiling on {cores + 1} cores",
                ],
                tp_rows,
            ),
            "Ceiling: the requests/s the measured CPU per request allows, when every process shares "
            "the cores left after their idle use and each EPP process (one Python thread) stops at "
            "one core. The cores are shared with other work on this machine, so measured requests/s "
            "sit below the ceilings.",
        ]
    )


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    figure, (lag_ax, tp_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rates = [str(int(r["rate"])) for r in data["lag"]]
    x = np.arange(len(rates))
    for offset, (key, label) in enumerate(
        [("publish_to_apply", "publish→apply"), ("routed_to_booked", "routed→booked")]
    ):
        lag_ax.bar(
            x + offset * 0.4 - 0.2, [r[f"{key}_p50_ms"] for r in data["lag"]], 0.4, label=f"{label} p50"
        )
        lag_ax.scatter(x + offset * 0.4 - 0.2, [r[f"{key}_p99_ms"] for r in data["lag"]], marker="_", s=400,
                       color="black")  # fmt: skip
    lag_ax.set(xticks=x, xticklabels=rates, xlabel="requests/s", ylabel="ms (bar p50, dash p99)",
               title="Sync lag, real NATS on loopback")  # fmt: skip
    lag_ax.legend()
    runs = data["throughput"]
    labels = [f"{r['epp_processes']} EPP" for r in runs]
    tp_ax.bar(labels, [r["rps"] for r in runs], label="measured")
    tp_ax.scatter(labels, [r["ceilings"][f"{data['machine']['cpus'] + 1}_cores_rps"] for r in runs],
                  marker="^", color="red", label="ceiling, one core more")  # fmt: skip
    tp_ax.set(ylabel="requests/s", title="Through Envoy (short completions)")
    tp_ax.legend()
    return save_figure(figure, out_dir, "sync.png")


def run(out_dir: Path, settings: SyncBenchSettings | None = None) -> dict[str, Any]:
    settings = settings or SyncBenchSettings()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llm-epp-sync-bench-") as tmp:
        work = Path(tmp)
        lag = measure_lag(settings, work)
        throughput = []
        for n in (1, 2):
            (work / f"epp{n}").mkdir()
            throughput.append(measure_throughput(n, settings, work / f"epp{n}"))
    cpus = os.cpu_count() or 1
    for r in throughput:
        r["ceilings"] = ceilings(r, cpus)
    data = {
        "machine": machine(),
        "command": "nice -n 10 llm-epp-bench sync",
        "load_average": [round(v, 2) for v in load_start],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "settings": settings.__dict__,
        "lag": lag,
        "throughput": throughput,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    data["plot"] = _plot(data, out_dir)
    write_results(out_dir, "sync", data, _markdown(data))
    return data
