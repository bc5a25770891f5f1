"""The EPP's KV-events subscriber against a real simulated server process and its ZMQ sockets.

The subscriber listens through a small proxy (a SUB/PUB pair in the test) that forwards the
server's batches unchanged but can drop some, so gaps happen when the test says; replay
requests go straight to the server's ROUTER socket, whose buffer holds the last
``BUFFER_STEPS`` batches. One batch per completion: each prompt is prefilled in one step.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.kv_events import KVEventsSubscriber
from epp.datalayer.metrics import KVEventMetrics, PoolMetrics
from epp.kvcache.block_hash import chain_hashes, external_hash
from epp.kvcache.precise_index import PreciseIndex
from epp.scheduling.types import Endpoint, EngineMetrics
from sim.processes import BIN, Component, free_port, http_ok, spawn, wait_until
from tests.support import eventually

pytestmark = pytest.mark.integration
BLOCK_SIZE = 32
BUFFER_STEPS = 4
NAME = "replica-0"
STALENESS_S = 0.5


@dataclass
class Server:
    url: str
    events: str
    replay: str
    workdir: Path


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # ipc:// paths are capped at 107 bytes: a short directory of its own.
    workdir = Path(tempfile.mkdtemp(prefix="kvsub-"))
    port = free_port()
    events, replay = f"ipc://{workdir}/events.sock", f"ipc://{workdir}/replay.sock"
    kv_events = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
        "replay_endpoint": replay, "buffer_steps": BUFFER_STEPS,
    }  # fmt: skip
    argv = [
        str(BIN / "llm-epp-sim"), "--host", "127.0.0.1", "--port", str(port), "--profile", "instant",
        "--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
    component: Component = spawn("sim", argv, workdir)
    try:
        wait_until(component, http_ok(f"http://127.0.0.1:{port}/health"))
        yield Server(f"http://127.0.0.1:{port}", events, replay, workdir)
    finally:
        component.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class DroppingProxy:
    """Forwards the server's PUB messages as they are, except those it is told to drop."""

    def __init__(self, context: zmq.asyncio.Context, upstream: str, downstream: str) -> None:
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(downstream)
        self.drop_next = 0
        self.paused = False
        self.dropped: list[int] = []
        self.forwarded: list[int] = []

    async def run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if self.paused or self.drop_next:
                self.drop_next = max(0, self.drop_next - 1)
                self.dropped.append(int.from_bytes(frames[1], "big"))
                continue
            await self._pub.send_multipart(frames)
            self.forwarded.append(int.from_bytes(frames[1], "big"))

    def close(self) -> None:
        self._sub.close(linger=0)
        self._pub.close(linger=0)


@dataclass
class Rig:
    server: Server
    http: httpx.AsyncClient
    proxy: DroppingProxy
    store: EndpointStore
    index: PreciseIndex
    subscriber: KVEventsSubscriber
    registry: CollectorRegistry
    endpoint: Endpoint

    async def complete(self, prompt: list[int]) -> None:
        response = await self.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        response.raise_for_status()

    def matched(self, prompt: list[int]) -> int:
        chain = [external_hash(d) for d in chain_hashes(prompt, BLOCK_SIZE)]
        return self.index.longest_prefix(chain).get(NAME, 0)

    def metric(self, metric: str, **labels: str) -> float:
        return self.registry.get_sample_value(metric, {"model_server_pod": NAME, **labels}) or 0.0


_seeds = iter(range(1000, 10**6))


def prompt(blocks: int = 2) -> list[int]:
    """A fresh prompt of ``blocks`` full blocks and a partial one (shares no block with others)."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(10, 2000) for _ in range(blocks * BLOCK_SIZE + 3)]


@pytest.fixture
async def rig(server: Server, tmp_path: Path) -> AsyncIterator[Rig]:
    context = zmq.asyncio.Context()
    downstream = f"ipc://{server.workdir}/proxy-{next(_seeds)}.sock"
    proxy = DroppingProxy(context, server.events, downstream)
    proxy_task = asyncio.create_task(proxy.run())
    store, index, registry = EndpointStore(), PreciseIndex(), CollectorRegistry()
    PoolMetrics(registry, "pool", store, asyncio.get_running_loop().time).track_kv_index(index)
    subscriber = KVEventsSubscriber(
        store,
        index,
        asyncio.get_running_loop().time,
        KVEventMetrics(registry),
        staleness_s=STALENESS_S,
        replay_timeout_s=2.0,
    )
    endpoint = Endpoint(
        NAME, "127.0.0.1", 1, kv_events_endpoint=downstream, kv_events_replay_endpoint=server.replay
    )
    store.replace([endpoint])
    subscriber.start()
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    rig = Rig(server, http, proxy, store, index, subscriber, registry, endpoint)
    try:
        # Both subscriptions (proxy and EPP) are live once a fresh prompt's batch gets through.
        for _ in range(50):
            primer = prompt(1)
            await rig.complete(primer)
            await asyncio.sleep(0.1)
            if rig.matched(primer) == 1:
                break
        else:
            raise AssertionError("the subscription never went live")
        yield rig
    finally:
        await http.aclose()
        await subscriber.close()
        proxy_task.cancel()
        await asyncio.gather(proxy_task, return_exceptions=True)
        proxy.close()
        context.destroy(linger=0)


async def test_catches_up_on_start_and_follows_stored_blocks(server: Server, rig: Rig) -> None:
    # Cached before this subscriber existed: learned from the start-up replay.
    earlier = prompt(3)
    await rig.complete(earlier)
    late = KVEventsSubscriber(
        rig.store, PreciseIndex(), asyncio.get_running_loop().time, rig.subscriber.metrics
    )
    late.start()  # subscribes to the store: the endpoint is already there
    try:
        await eventually(lambda: late.index.longest_prefix(
            [external_hash(d) for d in chain_hashes(earlier, BLOCK_SIZE)]
        ).get(NAME) == 3)  # fmt: skip
    finally:
        await late.close()
    # Live: a longer prompt sharing the first blocks stores only its new ones, chained.
    extended = earlier[: 3 * BLOCK_SIZE] + prompt(2)
    await rig.complete(extended)
    await eventually(lambda: rig.matched(extended) == 5)
    assert rig.metric("llm_epp_kv_events_received_total", type="BlockStored") >= 2
    assert rig.metric("llm_epp_kv_index_blocks", name="pool") == rig.index.blocks_held(NAME) >= 5
    assert rig.metric("llm_epp_kv_index_orphan_stores", name="pool") == 0  # every parent was known


def gaps(rig: Rig) -> dict[str, float]:
    """Gaps recovered so far, by outcome. Priming the subscription can take one: the proxy's
    subscription may start a batch later than the EPP's start-up replay ends."""
    return {o: rig.metric("llm_epp_kv_events_gaps_total", outcome=o) for o in ("replayed", "rebuilt")}


async def test_a_missed_batch_is_replayed(rig: Rig) -> None:
    missed, next_one = prompt(), prompt()
    earlier = gaps(rig)
    rig.proxy.drop_next = 1
    await rig.complete(missed)
    await eventually(lambda: len(rig.proxy.dropped) == 1)
    assert rig.matched(missed) == 0
    await rig.complete(next_one)  # its seq reveals the gap
    await eventually(lambda: rig.matched(next_one) == 2)
    assert rig.matched(missed) == 2
    assert gaps(rig) == {"replayed": earlier["replayed"] + 1, "rebuilt": earlier["rebuilt"]}


async def test_a_gap_replay_cannot_fill_rebuilds_the_endpoint(rig: Rig) -> None:
    before = prompt()
    await rig.complete(before)
    await eventually(lambda: rig.matched(before) == 2)
    earlier = gaps(rig)
    missed = [prompt() for _ in range(BUFFER_STEPS + 2)]
    rig.proxy.drop_next = len(missed)
    for p in missed:
        await rig.complete(p)
    await eventually(lambda: len(rig.proxy.dropped) == len(missed))
    after = prompt()
    await rig.complete(after)
    await eventually(lambda: rig.matched(after) == 2)
    assert gaps(rig) == {"replayed": earlier["replayed"], "rebuilt": earlier["rebuilt"] + 1}
    # Rebuilt from what the server's buffer still had: the latest batches, never older ones.
    recent = BUFFER_STEPS - 1
    assert [rig.matched(p) for p in missed] == [0] * (len(missed) - recent) + [2] * recent
    assert rig.matched(before) == 0  # still cached on the server, but no longer known here


async def test_all_blocks_cleared_resets_the_endpoint(rig: Rig) -> None:
    kept = prompt()
    await rig.complete(kept)
    await eventually(lambda: rig.matched(kept) == 2)
    assert (await rig.http.post("/reset_prefix_cache")).json() == {"success": True}
    fresh = prompt()
    await rig.complete(fresh)  # the clear goes out with this step
    await eventually(lambda: rig.matched(fresh) == 2)
    assert rig.matched(kept) == 0
    assert rig.index.blocks_held(NAME) == 2
    assert rig.metric("llm_epp_kv_events_received_total", type="AllBlocksCleared") == 1


async def test_silence_from_a_busy_engine_falls_back_until_events_resume(rig: Rig) -> None:
    rig.proxy.paused = True
    paused_at = asyncio.get_running_loop().time()
    # Idle, silence is no fault: once silent for longer than the staleness bound, the check
    # (run here, not left to the watchdog's timing) keeps the endpoint live.
    await eventually(lambda: asyncio.get_running_loop().time() - paused_at > 2 * STALENESS_S)
    rig.subscriber.check_staleness()
    assert rig.index.is_live(NAME)
    # Busy (per its metrics) and silent: stale.
    rig.store.record_scrape(NAME, EngineMetrics(running=2, updated_at=asyncio.get_running_loop().time()))
    await eventually(lambda: not rig.index.is_live(NAME), timeout_s=5 * STALENESS_S)
    assert rig.metric("llm_epp_kv_events_fallback_total") == 1
    assert rig.metric("llm_epp_kv_events_stale", name="pool") == 1
    # A batch gets through again: live, and replay fills what was missed meanwhile.
    missed = prompt()
    await rig.complete(missed)
    rig.proxy.paused = False
    resumed = prompt()
    await rig.complete(resumed)
    await eventually(lambda: rig.index.is_live(NAME) and rig.matched(resumed) == 2)
    assert rig.matched(missed) == 2
    assert rig.metric("llm_epp_kv_events_stale", name="pool") == 0


async def test_a_removed_endpoint_leaves_the_index(rig: Rig) -> None:
    cached = prompt()
    await rig.complete(cached)
    await eventually(lambda: rig.matched(cached) == 2)
    rig.store.replace([])
    assert rig.index.endpoints() == [] and len(rig.index) == 0
    received = rig.metric("llm_epp_kv_events_received_total", type="BlockStored")
    forwarded = len(rig.proxy.forwarded)
    await rig.complete(prompt())
    # Evidence that its batch went out to subscribers; the next completion's HTTP round trip on this
    # loop is the time a live subscription (a task on this loop) would have had to apply it.
    await eventually(lambda: len(rig.proxy.forwarded) == forwarded + 1)
    await rig.complete(prompt())
    await eventually(lambda: len(rig.proxy.forwarded) == forwarded + 2)
    assert len(rig.index) == 0  # its subscription ended with it
    assert rig.metric("llm_epp_kv_events_received_total", type="BlockStored") == received
    rig.store.replace([rig.endpoint])  # back: subscribed again, and caught up by replay
    await eventually(lambda: rig.matched(cached) == 2)
