"""Follows every engine's vLLM KV events into the EPP's precise prefix index.

One task per endpoint that has a ``kv_events_endpoint``, started and stopped as the store adds
and removes endpoints (like the metrics scraper); a removed endpoint's blocks leave the index.
Each task connects a ZMQ SUB socket to the engine's publisher (the engine binds: give vLLM
``tcp://*:PORT`` or an ``ipc://`` path), first replays the engine's recent history when a
``kv_events_replay_endpoint`` is known, then applies live batches through an
:class:`~epp.kvcache.events.EventStream`. A sequence gap is recovered by asking the replay
socket for the missing batches; when replay cannot fill it (no replay socket, history gone,
no answer within ``replay_timeout_s``) the endpoint's entries are cleared and rebuilt from
what replay still had.

Staleness: an engine publishes only when it steps, so silence from an idle engine is no
fault. An endpoint goes stale when its engine reports running or waiting requests (last
metrics scrape) and no batch has come for ``staleness_s``; it stays stale until a batch comes.
A stale endpoint, like one without a KV-event source, is scored from the approximate index.
Metrics: ``llm_epp_kv_events_received_total{type}``, ``llm_epp_kv_events_gaps_total{outcome}``,
``llm_epp_kv_events_fallback_total``, ``llm_epp_kv_events_stale``, ``llm_epp_kv_index_blocks``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.metrics import KVEventMetrics
from epp.kvcache.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventStream,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
)
from epp.kvcache.precise_index import PreciseIndex
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)


@dataclass
class _Subscription:
    endpoint: Endpoint
    stream: EventStream
    last_batch_at: float
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class KVEventsSubscriber:
    """Keeps ``index`` equal to what the engines of ``store``'s endpoints report."""

    def __init__(
        self,
        store: EndpointStore,
        index: PreciseIndex,
        clock: Callable[[], float],
        metrics: KVEventMetrics,
        *,
        staleness_s: float = 5.0,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.store = store
        self.index = index
        self.clock = clock
        self.metrics = metrics
        self.staleness_s = staleness_s
        self.replay_timeout_s = replay_timeout_s
        self._context: zmq.asyncio.Context | None = None
        self._subscriptions: dict[str, _Subscription] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self.store.subscribe(on_added=self._start_endpoint, on_removed=self._stop_endpoint)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="kv-events-watchdog")

    async def close(self) -> None:
        tasks = [s.task for s in self._subscriptions.values() if s.task is not None]
        if self._watchdog is not None:
            tasks.append(self._watchdog)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subscriptions.clear()
        if self._context is not None:
            self._context.destroy(linger=0)

    def _start_endpoint(self, endpoint: Endpoint) -> None:
        if endpoint.kv_events_endpoint is None:
            return
        self._stop_endpoint(endpoint)
        self.index.add_endpoint(endpoint.name)
        subscription = _Subscription(endpoint, EventStream(self.index, endpoint.name), self.clock())
        subscription.task = asyncio.get_running_loop().create_task(
            self._follow(subscription), name=f"kv-events-{endpoint.name}"
        )
        self._subscriptions[endpoint.name] = subscription

    def _stop_endpoint(self, endpoint: Endpoint) -> None:
        subscription = self._subscriptions.pop(endpoint.name, None)
        if subscription is not None and subscription.task is not None:
            subscription.task.cancel()
        self.index.remove_endpoint(endpoint.name)

    # ------------------------------------------------------------------ staleness

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.staleness_s / 4)
            self.check_staleness()

    def check_staleness(self) -> None:
        """Mark stale every live endpoint whose busy engine has sent nothing for ``staleness_s``."""
        now = self.clock()
        for name, subscription in self._subscriptions.items():
            state = self.store.by_name(name)
            busy = state is not None and state.metrics.running + state.metrics.waiting > 0
            if busy and now - subscription.last_batch_at > self.staleness_s and self.index.is_live(name):
                log.warning(
                    "KV events of %s stale (none for %.1f s while busy): using the approximate index",
                    name,
                    now - subscription.last_batch_at,
                )
                self.index.set_stale(name, True)
                self.metrics.kv_event_fallbacks.labels(name).inc()

    # ------------------------------------------------------------------ one endpoint

    async def _follow(self, subscription: _Subscription) -> None:
        assert self._context is not None, "start() first"
        endpoint, stream = subscription.endpoint, subscription.stream
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.connect(endpoint.kv_events_endpoint)  # type: ignore[arg-type]
            if endpoint.kv_events_replay_endpoint is not None:
                stream.catch_up(await self._replay(endpoint, 0))
            while True:
                frames = await sub.recv_multipart()
                self._received_batch(subscription)
                try:
                    if len(frames) != 3:
                        raise KVEventDecodeError(f"{len(frames)} frames")
                    batch = decode_batch(frames[1], frames[2])
                except KVEventDecodeError as exc:
                    # Skipped: the next batch shows a gap, and replay (or a rebuild) covers it.
                    log.warning("undecodable KV events batch from %s: %s", endpoint.name, exc)
                    self.metrics.kv_events.labels(endpoint.name, "invalid").inc()
                    continue
                self._count(endpoint.name, [batch])
                restarts = stream.restarts
                start = stream.accept(batch)
                if stream.restarts != restarts:
                    self.metrics.kv_event_gaps.labels(endpoint.name, "restarted").inc()
                if start is not None:
                    await self._recover(endpoint, stream, start, batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events subscription of %s ended", endpoint.name)
        finally:
            sub.close(linger=0)

    def _received_batch(self, subscription: _Subscription) -> None:
        subscription.last_batch_at = self.clock()
        name = subscription.endpoint.name
        if not self.index.is_live(name):
            log.info("KV events of %s resumed", name)
            self.index.set_stale(name, False)

    async def _recover(self, endpoint: Endpoint, stream: EventStream, start: int, live: EventBatch) -> None:
        replayed = await self._replay(endpoint, start) if endpoint.kv_events_replay_endpoint else []
        filled = stream.recover(replayed, live)
        outcome = "replayed" if filled else "rebuilt"
        log.log(
            logging.INFO if filled else logging.WARNING,
            "KV events of %s: batches %d..%d missed, %s",
            endpoint.name,
            start,
            live.seq - 1,
            outcome,
        )
        self.metrics.kv_event_gaps.labels(endpoint.name, outcome).inc()

    async def _replay(self, endpoint: Endpoint, start_seq: int) -> list[EventBatch]:
        """The batches from ``start_seq`` on that the engine's replay socket still has (as many
        as arrived within ``replay_timeout_s``)."""
        assert self._context is not None and endpoint.kv_events_replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        batches: list[EventBatch] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        try:
            dealer.connect(endpoint.kv_events_replay_endpoint)
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while (remaining := deadline - loop.time()) > 0:
                if not await dealer.poll(int(remaining * 1000) + 1):
                    break
                frames = await dealer.recv_multipart()
                try:
                    if len(frames) != 4:
                        raise KVEventDecodeError(f"replay message of {len(frames)} frames")
                    if decode_seq(frames[2]) == END_SEQ:
                        self._count(endpoint.name, batches)
                        return batches
                    batches.append(decode_batch(frames[2], frames[3]))
                except KVEventDecodeError as exc:
                    log.warning("undecodable KV events replay from %s: %s", endpoint.name, exc)
                    self.metrics.kv_events.labels(endpoint.name, "invalid").inc()
            log.warning("KV events replay of %s from seq %d timed out", endpoint.name, start_seq)
            self._count(endpoint.name, batches)
            return batches
        finally:
            dealer.close(linger=0)

    def _count(self, name: str, batches: list[EventBatch]) -> None:
        counts: dict[str, int] = {}
        for batch in batches:
            for event in batch.events:
                kind = _EVENT_TYPES[type(event)]
                counts[kind] = counts.get(kind, 0) + 1
            if batch.unknown:
                counts["unknown"] = counts.get("unknown", 0) + batch.unknown
        for kind, count in counts.items():
            self.metrics.kv_events.labels(name, kind).inc(count)


_EVENT_TYPES = {
    BlockStored: "BlockStored",
    BlockRemoved: "BlockRemoved",
    AllBlocksCleared: "AllBlocksCleared",
}
