"""The NATS transport of replica sync: the thin adapter between a ReplicaSyncState and NATS core.

Subjects, for sync pool P under the prefix X (``--sync-subject-prefix``, default ``llm-epp``):

==========================  ==================================================================
``X.P.events``              every replica's DELTAS and HEARTBEAT messages. One subject for both,
                            so each sender's messages reach a subscriber in the order sent
                            (NATS keeps one publisher's order; nats-py runs each subscription's
                            callbacks one at a time).
``X.P.snapshot.<replica>``  request/reply: that replica answers with its own bookings.
``X.P.scrapes``             with scrape sharing (``epp.sync.scrape_share``): every replica's
                            SCRAPES, the latest scrapes of the endpoints it owns, at most one
                            message per ``scrape_batch_s`` (the fast scrape tick). Replicas
                            before scrape sharing do not subscribe to it.
==========================  ==================================================================

Nothing on the request path waits for NATS: the pipeline hook only queues deltas in the state,
and this adapter publishes them on the next loop turn (or drops them, counted, while
disconnected; peers then see a gap and ask for a snapshot). It never stops trying to connect,
so an EPP starts, and routes on its own state, with NATS down. On every (re)connection the
state re-snapshots its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from collections.abc import Coroutine, Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from epp.sync.messages import MessageKind
from epp.sync.metrics import SyncMetrics
from epp.sync.scrape_share import ScrapeShare
from epp.sync.state import ReplicaSyncState

log = logging.getLogger(__name__)


def default_replica_id() -> str:
    """``hostname-pid``, with every character a NATS subject token cannot hold replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{socket.gethostname()}-{os.getpid()}")


class NatsSyncTransport:
    """Publishes ``state``'s deltas and heartbeats, applies its peers', answers and asks for snapshots."""

    def __init__(
        self,
        state: ReplicaSyncState,
        servers: list[str],
        subject_root: str,
        *,
        connect_options: Mapping[str, Any] | None = None,
        snapshot_timeout_s: float = 1.0,
        metrics: SyncMetrics | None = None,
        scrape_share: ScrapeShare | None = None,
        scrape_batch_s: float = 0.05,
    ) -> None:
        """``subject_root`` is ``X.P`` (see the module); ``connect_options`` go to ``nats.connect``.
        With ``scrape_share``, its messages go out on ``X.P.scrapes``, at most every ``scrape_batch_s``."""
        self.state = state
        self.servers = servers
        self.events_subject = f"{subject_root}.events"
        self.scrapes_subject = f"{subject_root}.scrapes"
        self.scrape_share = scrape_share
        self.scrape_batch_s = scrape_batch_s
        self._snapshot_root = f"{subject_root}.snapshot"
        self.connect_options = dict(connect_options or {})
        self.snapshot_timeout_s = snapshot_timeout_s
        self.metrics = metrics
        self.last_error: str | None = None
        self._closing = False
        self._nc = Client()
        self._wake = asyncio.Event()
        self._scrapes_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._asks: set[asyncio.Task[None]] = set()

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    def snapshot_subject(self, replica: str) -> str:
        return f"{self._snapshot_root}.{replica}"

    async def start(self) -> None:
        """Start connecting in the background (this returns at once, whether NATS is up or not)."""
        self.state.connection_lost()  # until connected: expire no one
        self.state.on_pending = self._wake.set
        if self.scrape_share is not None:
            self.scrape_share.on_pending = self._scrapes_wake.set
        self._spawn(self._run(), "sync-nats")

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coroutine, name=name))

    async def _run(self) -> None:
        await self._nc.connect(
            self.servers,
            name=f"llm-epp {self.state.replica_id}",
            no_echo=True,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            ping_interval=5,
            max_outstanding_pings=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_connected,
            **self.connect_options,
        )
        await self._nc.subscribe(self.events_subject, cb=self._on_event)
        await self._nc.subscribe(self.snapshot_subject(self.state.replica_id), cb=self._on_snapshot_request)
        if self.scrape_share is not None:
            await self._nc.subscribe(self.scrapes_subject, cb=self._on_scrapes)
        await self._nc.flush()
        log.info("sync: connected to NATS as %s on %s", self.state.replica_id, self.events_subject)
        await self._on_connected()
        self._spawn(self._publish_loop(), "sync-publish")
        self._spawn(self._tick_loop(), "sync-tick")
        self._spawn(self._heartbeat_loop(), "sync-heartbeat")
        if self.scrape_share is not None:
            self._spawn(self._scrapes_loop(self.scrape_share), "sync-scrapes")

    async def _on_connected(self) -> None:
        self.state.connection_restored()
        if self.metrics is not None:
            self.metrics.connected.set(1)
        self._ask_snapshots()
        self._wake.set()

    async def _on_disconnected(self) -> None:
        self.state.connection_lost()
        if self.metrics is not None:
            self.metrics.connected.set(0)
        if not self._closing:
            log.warning("sync: lost NATS; routing on own and last known remote state until it is back")

    async def _on_error(self, error: Exception) -> None:
        text = str(error) or type(error).__name__
        if text != self.last_error:
            log.warning("sync: NATS: %s", text)
        self.last_error = text

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._publish_pending()
            # What changes meanwhile waits for the next take, one TOTALS per endpoint: this
            # bounds the peers' apply work whatever the request rate (epp.sync.state).
            await asyncio.sleep(self.state.tuning.publish_interval_s)

    async def _publish_pending(self) -> None:
        for data in self.state.take_messages():
            await self._publish(data)

    async def _publish(self, data: bytes) -> None:
        if not self._nc.is_connected:
            self.state.unsent(data)
            return
        try:
            await self._nc.publish(self.events_subject, data)
        except NatsError as exc:
            self.state.unsent(data)
            await self._on_error(exc)

    async def _scrapes_loop(self, share: ScrapeShare) -> None:
        while True:
            await self._scrapes_wake.wait()
            self._scrapes_wake.clear()
            data = share.take_message()
            if data is None:
                continue
            if not self._nc.is_connected:
                share.unsent(data)
                continue
            try:
                await self._nc.publish(self.scrapes_subject, data)
            except NatsError as exc:
                share.unsent(data)
                await self._on_error(exc)
            # Results that come meanwhile wait for the next take: one message a tick, each
            # endpoint in it once, however many replicas and endpoints.
            await asyncio.sleep(self.scrape_batch_s)

    async def _on_scrapes(self, msg: Msg) -> None:
        assert self.scrape_share is not None
        self.scrape_share.receive(msg.data)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.state.tuning.progress_interval_s)
            self.state.flush()
            # Checked on this short tick, not once a heartbeat, so a dead peer's bookings leave
            # within peer_timeout_s of its last heartbeat plus one progress interval.
            self.state.expire()

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._publish_pending()
            if self._nc.is_connected:
                await self._publish(self.state.heartbeat())
            self._ask_snapshots()
            await asyncio.sleep(self.state.tuning.heartbeat_interval_s)

    async def _on_event(self, msg: Msg) -> None:
        received = self.state.receive(msg.data)
        if received is not None and received.kind == MessageKind.DELTAS and self.metrics is not None:
            self.metrics.lag.observe(max(0.0, received.lag_s))
        self._ask_snapshots()

    async def _on_snapshot_request(self, msg: Msg) -> None:
        reply = self.state.answer(msg.data)
        if reply is None or not msg.reply:
            return
        try:
            await msg.respond(reply)
        except NatsError as exc:
            await self._on_error(exc)

    def _ask_snapshots(self) -> None:
        for replica in self.state.wanted_snapshots():
            task = asyncio.create_task(self._ask(replica), name=f"sync-snapshot-{replica}")
            self._asks.add(task)
            task.add_done_callback(self._asks.discard)

    async def _ask(self, replica: str) -> None:
        try:
            reply = await self._nc.request(
                self.snapshot_subject(replica), self.state.snapshot_request(), timeout=self.snapshot_timeout_s
            )
        except (TimeoutError, NatsError) as exc:
            log.info("sync: no snapshot from %s (%s); asking again later", replica, exc or type(exc).__name__)
            self.state.snapshot_failed(replica)
            return
        if self.state.receive(reply.data) is None:
            self.state.snapshot_failed(replica)

    async def close(self) -> None:
        """Publish what is queued, then disconnect."""
        self._closing = True
        if self._nc.is_connected:
            await self._publish_pending()
            with contextlib.suppress(TimeoutError, NatsError):
                await self._nc.flush(timeout=1)
        for task in [*self._tasks, *self._asks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._asks, return_exceptions=True)
        await self._nc.close()
        if self.metrics is not None:
            self.metrics.connected.set(0)
