"""``llm-epp-bench scrape-share``: each synced replica's scrape CPU with scrape sharing, against K.

**Live.** ``endpoints`` stub engines (one Envoy, ``bench.harness.stub_engine``, answering the real 55 KB
vLLM 0.32 scrape, as in ``bench.runs.idle_cost``), a nats-server, and K EPP processes synced through it
(``--sync-nats-url``), every endpoint on the fast tick (``--idle-scrape-interval-s 0.05``), no
traffic: what each replica spends on the pool's metrics. Per K and arm (scrape sharing on, and
off for K > 1), once every replica has heard all its peers and ``settle_s`` passed, each EPP's CPU
(all its threads, ``/proc``) is read over ``idle_s``, with its scrapes (the stub engines' are not
told apart, so ``llm_epp_sync_scrapes_published_total`` counts the owner's) and the shared figures
it applied. The load average before each reading goes in the results.

**One replica, in process.** The live figures above mix K EPPs, Envoy and nats-server on the
machine's cores, and the stub engines' throughput caps what each EPP scrapes; so one replica is
also measured alone, in process: its scraper (the EPP's, uvloop) polling the same stub engines on
the fast tick as one of K replicas that share scrapes (it has heard K − 1 sharing peers), fed the
peers' SCRAPES of the endpoints they own every fast tick as NATS would deliver them (built in the
same thread, their CPU measured and taken off): its thread's CPU per second, and its scrapes;
and the same replica scraping only the engines it owns, alone: the difference is what the
engines it does not own cost it.

**In process.** A receiver's CPU per shared endpoint figure: an owner's SCRAPES messages of 1 and
of ``endpoints`` endpoints, applied by another replica's :class:`~epp.sync.scrape_share.ScrapeShare`
to its store; the second less the first, per endpoint, is a figure's cost (what
``bench.runs.capacity`` takes as ``share_apply_us``), the first less that a message's.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.harness.process_cpu import task_cpu_seconds
from bench.harness.stub_engine import stub_engine_bootstrap
from bench.runs.idle_cost import VLLM_SCRAPE, ms_per_s
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.keepalive_http import KeepAliveHttp
from epp.scheduling.types import Endpoint, EngineMetrics
from epp.sync.messages import Capability
from epp.sync.scrape_owners import owner as scrape_owner
from epp.sync.scrape_share import ScrapeShare
from epp.sync.state import ReplicaSyncState, SyncTargets
from sim.measure.prometheus_samples import Samples, scrape
from sim.measure.report import machine, markdown_table, write_results
from sim.models import TINY_MODEL_DIR
from sim.nats_server import start_nats_server
from sim.processes import Component, free_port, start_envoy, start_epp, wait_until, write_endpoints_file

FAST_TICK = ("--idle-scrape-interval-s", "0.05")


@dataclass
class ScrapeShareSettings:
    replicas: tuple[int, ...] = (1, 2, 4)
    endpoints: int = 100
    idle_s: float = 10.0
    settle_s: float = 3.0
    apply_messages: int = 200


def _value(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _measure(k: int, share: bool, settings: ScrapeShareSettings, workdir: Path) -> dict[str, Any]:
    """K synced EPPs over the stub engines: each one's CPU and scrape counts over ``idle_s``."""
    ports = [free_port() for _ in range(settings.endpoints)]
    nats_port = free_port()
    components: list[Component] = []
    try:
        bootstrap = stub_engine_bootstrap(ports, VLLM_SCRAPE.read_text())
        components.append(start_envoy("stub-engines", bootstrap, workdir, concurrency=1))
        components.append(start_nats_server(workdir, nats_port))
        endpoints_file = write_endpoints_file(workdir / "endpoints.yaml", [("127.0.0.1", p) for p in ports])
        epps: list[tuple[Component, str]] = []
        for i in range(k):
            metrics_port = free_port()
            epp = start_epp(
                workdir,
                endpoints_file,
                grpc_port=free_port(),
                health_port=free_port(),
                metrics_port=metrics_port,
                expected_endpoints=settings.endpoints,
                tokenizer=TINY_MODEL_DIR,
                name=f"epp-{i}",
                extra_args=[
                    "--log-level",
                    "WARNING",
                    *FAST_TICK,
                    "--sync-nats-url",
                    f"nats://127.0.0.1:{nats_port}",
                    "--replica-id",
                    f"epp-{i}",
                    "--sync-share-scrapes" if share else "--no-sync-share-scrapes",
                ],
            )
            components.append(epp)
            epps.append((epp, f"http://127.0.0.1:{metrics_port}/metrics"))
        for epp, url in epps:
            wait_until(epp, lambda u=url: _value(scrape(u), "llm_epp_sync_peers_alive") == k - 1)
        time.sleep(settings.settle_s)
        load_1m = os.getloadavg()[0]
        before = [(task_cpu_seconds(epp.process.pid), scrape(url)) for epp, url in epps]
        started = time.monotonic()
        time.sleep(settings.idle_s)
        wall = time.monotonic() - started
        per_replica = []
        for (epp, url), (cpu, samples) in zip(epps, before, strict=True):
            after = scrape(url)

            def rate(name: str, a: Samples = after, b: Samples = samples) -> float:
                return round((_value(a, name) - _value(b, name)) / wall, 1)

            per_replica.append(
                {
                    "ms_per_s": round(ms_per_s(cpu, task_cpu_seconds(epp.process.pid), wall), 1),
                    "published_per_s": rate("llm_epp_sync_scrapes_published_total"),
                    "applied_per_s": rate("llm_epp_sync_scrapes_applied_total"),
                    "fallback_per_s": rate("llm_epp_sync_scrapes_fallback_total"),
                    "dropped_per_s": rate("llm_epp_sync_scrapes_dropped_total"),
                    "owned": _value(after, "llm_epp_sync_scrapes_owned"),
                }
            )
    finally:
        for component in reversed(components):
            component.stop()
    cpu = [r["ms_per_s"] for r in per_replica]
    return {
        "replicas": k,
        "share": share,
        "endpoints": settings.endpoints,
        "mean_ms_per_s": round(sum(cpu) / k, 1),
        "total_ms_per_s": round(sum(cpu), 1),
        "per_replica": per_replica,
        "load_1m_before": round(load_1m, 2),
    }


class _CountingScraper(MetricsScraper):
    scrapes = 0

    async def scrape_once(self, name: str, client: KeepAliveHttp) -> None:
        self.scrapes += 1
        await super().scrape_once(name, client)


def _sharing(name: str, names: list[str], peers: list[str]) -> ScrapeShare:
    """A replica's scrape share over ``names`` that has heard ``peers`` announce sharing."""
    state = ReplicaSyncState(
        name, SyncTargets(), clock=time.monotonic, incarnation=1, capabilities=Capability.SHARES_SCRAPES
    )
    for peer in peers:
        state.receive(
            ReplicaSyncState(
                peer,
                SyncTargets(),
                clock=time.monotonic,
                incarnation=1,
                capabilities=Capability.SHARES_SCRAPES,
            ).heartbeat()
        )
    store = EndpointStore()
    store.replace([Endpoint(n, "127.0.0.1", 0) for n in names])
    return ScrapeShare(state, store, clock=time.monotonic, stale_after_s=0.15)


async def _one_replica(k: int, ports: list[int], seconds: float) -> dict[str, float]:
    """One of ``k`` replicas sharing scrapes of the stub engines at ``ports``, in this thread."""
    names = [f"e{i}" for i in range(len(ports))]
    replicas = [f"epp-{i}" for i in range(k)]
    store = EndpointStore()
    scraper = _CountingScraper(store, time.monotonic, interval=0.05, idle_interval=0.05)
    share = ScrapeShare(
        _sharing("epp-0", names, replicas[1:]).state, store, clock=time.monotonic, stale_after_s=0.15
    )
    scraper.share = share
    peers = [_sharing(peer, names, [r for r in replicas if r != peer]) for peer in replicas[1:]]
    feeding = [0.0]

    async def feed() -> None:
        """The peers' SCRAPES every fast tick, of what each owns, as fresh as the tick."""
        while True:
            started = time.thread_time()
            for peer in peers:
                for name in names:
                    if peer.owns(name):
                        peer.scraped(name, EngineMetrics(0, 0, 0.1, updated_at=time.monotonic()), 0.05)
                data = peer.take_message()
                feeding[0] += time.thread_time() - started
                if data is not None:
                    share.receive(data)
                started = time.thread_time()
            feeding[0] += time.thread_time() - started
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(feed())
    scraper.start()
    store.replace([Endpoint(n, "127.0.0.1", p) for n, p in zip(names, ports, strict=True)])
    try:
        await asyncio.sleep(2.0)
        scrapes, applied, fed = scraper.scrapes, share.stats.applied, feeding[0]
        cpu, wall = time.thread_time(), time.monotonic()
        await asyncio.sleep(seconds)
        wall = time.monotonic() - wall
        cpu = time.thread_time() - cpu - (feeding[0] - fed)
        return {
            "replicas": k,
            "ms_per_s": round(cpu * 1e3 / wall, 1),
            "scrapes_per_s": round((scraper.scrapes - scrapes) / wall, 1),
            "applied_per_s": round((share.stats.applied - applied) / wall, 1),
        }
    finally:
        feeder.cancel()
        await scraper.close()


def measure_one_replica(settings: ScrapeShareSettings, workdir: Path) -> list[dict[str, float]]:
    """:func:`_one_replica` for each K, against one set of stub engines."""
    ports = [free_port() for _ in range(settings.endpoints)]
    bootstrap = stub_engine_bootstrap(ports, VLLM_SCRAPE.read_text())
    envoy = start_envoy("stub-engines", bootstrap, workdir, concurrency=1)
    try:
        results = []
        names = [f"e{i}" for i in range(len(ports))]
        for k in settings.replicas:
            replicas = [f"epp-{i}" for i in range(k)]
            own = [p for n, p in zip(names, ports, strict=True) if scrape_owner(n, replicas) == "epp-0"]
            load_1m = os.getloadavg()[0]
            measured = uvloop.run(_one_replica(k, ports, settings.idle_s))
            # The same replica scraping only the engines it owns, alone: what the others cost it.
            alone = uvloop.run(_one_replica(1, own, settings.idle_s))
            results.append(
                {
                    **measured,
                    "owned": len(own),
                    "alone_on_owned_ms_per_s": alone["ms_per_s"],
                    "load_1m_before": round(load_1m, 2),
                }
            )
            print(f"one replica of K={k}: {results[-1]}", flush=True)
        return results
    finally:
        envoy.stop()


def _apply_us(endpoints: int, per_message: int, messages: int) -> float:
    """CPU µs per message for a replica to apply ``messages`` SCRAPES of ``per_message`` endpoints."""
    # Endpoints that "owner" owns between the two (it publishes only those, and only to a peer).
    candidates = (f"10.0.{i // 250}.{i % 250}:8000" for i in range(64 * endpoints))
    names = [n for n in candidates if scrape_owner(n, ("owner", "receiver")) == "owner"][:endpoints]
    replicas = []
    # The owner's clock stands still, so every figure is 10 ms old and the receiver, on the real
    # clock, finds each newer than the last.
    for name, clock in (("owner", lambda: 0.0), ("receiver", time.monotonic)):
        state = ReplicaSyncState(
            name, SyncTargets(), clock=clock, incarnation=1, capabilities=Capability.SHARES_SCRAPES
        )
        store = EndpointStore()
        store.replace([Endpoint(n, n.split(":")[0], 8000) for n in names])
        replicas.append(ScrapeShare(state, store, clock=clock, stale_after_s=0.15))
    owner, receiver = replicas
    owner.state.receive(receiver.state.heartbeat())
    wire = []
    for i in range(messages):
        for name in names[:per_message]:
            figures = EngineMetrics(i % 7, i % 13, 0.5, 16, 40_000, updated_at=-0.01)
            owner.scraped(name, figures, 0.05)
        data = owner.take_message()
        assert data is not None
        wire.append(data)
    started = time.thread_time()
    for data in wire:
        assert receiver.receive(data) == per_message
    return (time.thread_time() - started) / messages * 1e6


def measure_share_apply_us(endpoints: int, messages: int) -> dict[str, float]:
    """CPU µs to apply a SCRAPES message of one endpoint and one of all ``endpoints``; the second
    less the first, per endpoint, is a shared figure's; the first less that, a message's."""
    one = _apply_us(endpoints, 1, messages)
    every = _apply_us(endpoints, endpoints, messages)
    figure = (every - one) / (endpoints - 1)
    return {
        "one_endpoint_us": one,
        "every_endpoint_us": every,
        "figure_us": figure,
        "message_us": one - figure,
    }


def _markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = [
        [
            r["replicas"],
            "on" if r["share"] else "off",
            f"{r['mean_ms_per_s']:.1f}",
            " / ".join(f"{p['ms_per_s']:.0f}" for p in r["per_replica"]),
            " / ".join(f"{p['published_per_s']:.0f}" for p in r["per_replica"]),
            " / ".join(f"{p['applied_per_s']:.0f}" for p in r["per_replica"]),
            " / ".join(f"{p['fallback_per_s']:.1f}" for p in r["per_replica"]),
            f"{r['load_1m_before']:.2f}",
        ]
        for r in data["results"]
    ]
    a = data["apply"]
    return "\n\n".join(
        [
            "# Scrape sharing: each replica's scrape CPU against the replica count",
            f"{s['endpoints']} stub engines (55 KB vLLM scrape) on the 50 ms tick, no traffic, K EPPs "
            f"synced through nats-server; each EPP's CPU over {s['idle_s']:g} s after {s['settle_s']:g} s. "
            f"Machine: {data['machine']['cpus']} CPUs, {data['machine']['date']}.",
            markdown_table(
                [
                    "K",
                    "sharing",
                    "EPP CPU per replica, mean (ms/s)",
                    "each replica (ms/s)",
                    "published figures/s",
                    "applied figures/s",
                    "fallback scrapes/s",
                    "load average (1 min) before",
                ],
                rows,
            ),
            "One replica in process (its thread's CPU, the peers' messages built in the same thread "
            "and taken off):",
            markdown_table(
                [
                    "K",
                    "CPU (ms/s)",
                    "its scrapes/s",
                    "shared figures applied/s",
                    "owned engines",
                    "alone, on the owned engines only (ms/s)",
                    "load average (1 min) before",
                ],
                [
                    [
                        r["replicas"],
                        f"{r['ms_per_s']:.1f}",
                        f"{r['scrapes_per_s']:.0f}",
                        f"{r['applied_per_s']:.0f}",
                        r["owned"],
                        f"{r['alone_on_owned_ms_per_s']:.1f}",
                        f"{r['load_1m_before']:.2f}",
                    ]
                    for r in data["one_replica"]
                ],
            ),
            f"Applying shared figures, in process: {a['figure_us']:.2f} µs per endpoint figure, "
            f"{a['message_us']:.1f} µs per message besides ({a['every_endpoint_us']:.0f} µs for a message "
            f"of all {s['endpoints']}).",
        ]
    )


def run(out_dir: Path, settings: ScrapeShareSettings | None = None) -> dict[str, Any]:
    settings = settings or ScrapeShareSettings()
    apply = measure_share_apply_us(settings.endpoints, settings.apply_messages)
    print(f"apply: {apply}", flush=True)
    results = []
    arms = [(k, True) for k in settings.replicas] + [(k, False) for k in settings.replicas if k > 1]
    for k, share in arms:
        with tempfile.TemporaryDirectory(prefix="llm-epp-scrape-share-") as workdir:
            measured = _measure(k, share, settings, Path(workdir))
        results.append(measured)
        print(f"K={k}, sharing {'on' if share else 'off'}: {measured}", flush=True)
    with tempfile.TemporaryDirectory(prefix="llm-epp-scrape-share-") as workdir:
        one = measure_one_replica(settings, Path(workdir))
    data = {
        "machine": machine(),
        "settings": asdict(settings),
        "results": results,
        "one_replica": one,
        "apply": apply,
    }
    write_results(out_dir, "scrape-share", data, _markdown(data))
    return data
