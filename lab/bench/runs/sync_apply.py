"""``llm-epp-bench sync-apply``: a replica's CPU for applying its peers' sync, against the pool's rate.

In process, pure state, virtual time (no NATS, no asyncio): 4 replicas of one pool share 100
endpoints; requests arrive at R requests/s pool-wide, round-robin over the replicas (as Envoy
spreads ext_proc streams), each to a random endpoint. Three replicas route theirs through their
``ReplicaSyncState`` (routed; first token after ``ttft_s``; decode progress every sync tick;
released after ``e2e_s``; every prompt with a tail, a third with a TPOT SLO). Their messages are
taken every ``take_s`` (the live transport's publish interval) and the fourth replica applies
them all. Reported per rate, in thread CPU time: the fourth replica's ``receive`` per second of
sync (µs/s), and each sender's sync calls per second (the lifecycle, ticks and takes, without
its pipeline's own work); deltas and messages applied per second, bytes received per second.
Prefix-index inserts are left out: they are not coalesced (one per routed prompt with new
blocks, bounded by the unique prompt content, not by the load sync this measures).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from epp.load.peer_totals import PeerTotals
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from sim.measure.report import machine, markdown_table, save_figure, write_results


@dataclass(frozen=True)
class SyncApplySettings:
    rates: tuple[float, ...] = (100.0, 1_000.0, 10_000.0)
    """Requests per second, pool-wide."""
    endpoints: int = 100
    replicas: int = 4
    warmup_s: float = 1.0
    """Virtual seconds before timing starts (the pool fills up to its steady in-flight count)."""
    measure_s: float = 2.0
    ttft_s: float = 0.1
    e2e_s: float = 1.0
    take_s: float = SyncTuning().publish_interval_s
    """How often the senders' messages are taken (the live transport's publish interval)."""
    seed: int = 0


ENDPOINT_NAMES = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(1000)]


@dataclass(order=True)
class _Event:
    at: float
    order: int
    kind: str
    sender: int
    key: int


def _states(settings: SyncApplySettings, clock: list[float]) -> list[ReplicaSyncState]:
    return [
        ReplicaSyncState(
            f"epp-{k}",
            SyncTargets(token_load=PeerTotals(), tpot_slos={}),
            clock=lambda: clock[0],
            tuning=SyncTuning(),
            incarnation=1,
        )
        for k in range(settings.replicas)
    ]


class _Pool:
    """The senders' requests as timed events, and the receiver's timed apply work."""

    def __init__(self, rate: float, settings: SyncApplySettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.clock = [0.0]
        *self.senders, self.receiver = _states(settings, self.clock)
        for sender in self.senders:
            self.receiver.receive(sender.heartbeat())
        self.endpoints = ENDPOINT_NAMES[: settings.endpoints]
        self.events: list[_Event] = []
        self.order = itertools.count()
        self.decoding: list[dict[int, int]] = [{} for _ in self.senders]
        self.applied_s, self.published_s, self.messages, self.bytes = 0.0, 0.0, 0, 0
        # Request i goes to replica i mod K; the receiver's own requests need no sync: skipped.
        end = settings.warmup_s + settings.measure_s
        for i in range(int(end * rate)):
            if i % settings.replicas < len(self.senders):
                self.schedule(i / rate, "routed", i % settings.replicas, i)

    def schedule(self, at: float, kind: str, sender: int, key: int) -> None:
        heapq.heappush(self.events, _Event(at, next(self.order), kind, sender, key))

    def step(self, event: _Event) -> None:
        state, s = self.senders[event.sender], self.settings
        if event.kind == "routed":
            prompt = self.rng.randint(200, 4000)
            state.routed(
                event.key,
                self.rng.choice(self.endpoints),
                kv_tokens=prompt,
                uncached_tokens=prompt // 2,
                expected_output=200,
                tpot_slo_ms=50.0 if event.key % 3 == 0 else None,
                prompt_tail=self.rng.getrandbits(64),
            )
            self.schedule(event.at + s.ttft_s, "first", event.sender, event.key)
        elif event.kind == "first":
            state.first_token(event.key)
            self.decoding[event.sender][event.key] = 1
            self.schedule(event.at + s.e2e_s - s.ttft_s, "released", event.sender, event.key)
        else:
            state.released(event.key)
            del self.decoding[event.sender][event.key]

    def tick(self) -> None:
        """The sync tick: every streaming request got 10 more tokens; the senders flush."""
        for state, streaming in zip(self.senders, self.decoding, strict=True):
            for key in streaming:
                streaming[key] += 10
                state.progress(key, streaming[key])
            state.flush()

    def take(self, timed: bool) -> None:
        """The senders' messages reach the receiver (its apply timed if ``timed``)."""
        for state in self.senders:
            started = time.thread_time()
            messages = state.take_messages()
            if timed:
                self.published_s += time.thread_time() - started
            for data in messages:
                started = time.thread_time()
                self.receiver.receive(data)
                if timed:
                    self.applied_s += time.thread_time() - started
                    self.messages += 1
                    self.bytes += len(data)

    def run(self) -> None:
        s, clock = self.settings, self.clock
        end = s.warmup_s + s.measure_s
        tick = self.senders[0].tuning.progress_interval_s
        next_tick, next_take = tick, s.take_s
        while clock[0] < end:
            clock[0] = min(next_tick, next_take)
            started = time.thread_time()
            while self.events and self.events[0].at <= clock[0]:
                self.step(heapq.heappop(self.events))
            if clock[0] >= next_tick:
                self.tick()
                next_tick += tick
            if clock[0] > s.warmup_s:
                self.published_s += time.thread_time() - started
            if clock[0] >= next_take:
                self.take(timed=clock[0] > s.warmup_s)
                next_take += s.take_s


def measure(rate: float, settings: SyncApplySettings) -> dict[str, Any]:
    """One rate: the last replica's apply work while the others route ``rate`` requests/s in all."""
    pool = _Pool(rate, settings)
    pool.run()
    seconds = settings.measure_s
    applied = pool.receiver.stats.applied
    peers = pool.receiver.targets.token_load
    return {
        "rate": rate,
        "apply_us_per_s": round(pool.applied_s / seconds * 1e6, 1),
        "publish_us_per_s_per_sender": round(pool.published_s / len(pool.senders) / seconds * 1e6, 1),
        "messages_per_s": round(pool.messages / seconds, 1),
        "deltas_per_s": round(sum(applied.values()) / (settings.warmup_s + seconds), 1),
        "deltas_by_kind": dict(applied),
        "bytes_per_s": round(pool.bytes / seconds),
        "us_per_message": round(pool.applied_s / pool.messages * 1e6, 2) if pool.messages else None,
        "peer_requests_in_flight": peers.in_flight() if peers is not None else None,
    }


def _markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = [
        [
            f"{r['rate']:,.0f}",
            f"{r['apply_us_per_s']:,.0f}",
            f"{r['apply_us_per_s'] / 1e4:.2f}%",
            f"{r['publish_us_per_s_per_sender']:,.0f}",
            f"{r['messages_per_s']:,.0f}",
            f"{r['deltas_per_s']:,.0f}",
            f"{r['bytes_per_s'] / 1e3:,.0f}",
            f"{r['peer_requests_in_flight']:,}",
        ]
        for r in data["runs"]
    ]
    return "\n".join(
        [
            "# A replica's apply CPU for its peers' sync, against the pool's request rate",
            "",
            f"{s['replicas']} replicas, {s['endpoints']} endpoints; requests {s['ttft_s']:g} s to the first "
            f"token, {s['e2e_s']:g} s in all; messages taken every {s['take_s'] * 1e3:g} ms; the last "
            f"replica's `receive` timed over {s['measure_s']:g} virtual s after {s['warmup_s']:g} s of "
            f"warm-up. Machine: {data['machine']['cpus']} CPUs, Python {data['machine']['python']}, "
            f"{data['machine']['date']}.",
            "",
            markdown_table(
                [
                    "requests/s (pool)",
                    "apply µs per s",
                    "of one core",
                    "publish µs per s (each sender)",
                    "messages/s",
                    "deltas/s",
                    "kB/s received",
                    "peers' requests in flight",
                ],
                rows,
            ),
            "",
            "![sync-apply.png](sync-apply.png)",
        ]
    )


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    figure, axis = plt.subplots(figsize=(6, 4))
    runs = data["runs"]
    axis.plot([r["rate"] for r in runs], [r["apply_us_per_s"] / 1e3 for r in runs], marker="o")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("requests/s, pool-wide")
    axis.set_ylabel("apply CPU, ms per s")
    axis.set_title(f"One replica applying {data['settings']['replicas'] - 1} peers' sync")
    axis.grid(alpha=0.3, which="both")
    return save_figure(figure, out_dir, "sync-apply.png")


def run(out_dir: Path, settings: SyncApplySettings | None = None) -> dict[str, Any]:
    settings = settings or SyncApplySettings()
    data: dict[str, Any] = {
        "benchmark": "sync-apply",
        "machine": machine(),
        "settings": asdict(settings),
        "runs": [measure(rate, settings) for rate in settings.rates],
    }
    write_results(out_dir, "sync-apply", data, _markdown(data))
    _plot(data, out_dir)
    return data
