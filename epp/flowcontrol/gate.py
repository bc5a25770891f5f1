"""The live adapter: an awaitable gate the request path passes before the scheduler picks.

``FlowGate.admit`` queues the request; its :class:`Admission` says whether it is held, and
returns a :class:`FlowTicket` once the controller dispatches it, or raises :class:`RequestShed`
(429 with ``Retry-After``) when it expired or was pushed out of a full queue. The driver tells
the ticket where the request was routed and, once, that it finished (however it ended), which
releases its booking. A waiter that is cancelled or withdraws (the client hung up, so Envoy
reset the stream) leaves the queue at once. One dispatcher task re-polls the controller while
requests wait: at once when a request finishes or gets its first token, here or (with
:meth:`FlowGate.share_load`) at a peer replica, at the next expiry, and every
``pollIntervalMs`` otherwise (scrapes and predictions change unannounced).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from epp.errors import RequestShed
from epp.flowcontrol.config import FlowControl
from epp.flowcontrol.metrics import FlowMetrics
from epp.flowcontrol.peers import PeerTokenLoad
from epp.flowcontrol.types import Decision, Outcome
from epp.scheduling.framework import CycleState
from epp.scheduling.types import EndpointState, LLMRequest
from epp.sync.state import ReplicaSyncState

_SHED_MESSAGES = {
    Outcome.EXPIRED: "the pool is saturated and the request waited past its queue's time limit",
    Outcome.REJECTED: "the pool is saturated and the request's queue is full",
    Outcome.EVICTED: "the pool is saturated and the request gave way to higher-priority requests",
}


class FlowTicket:
    """A dispatched request's hold on the pool, from dispatch to finish."""

    __slots__ = ("_gate", "endpoints", "key")

    def __init__(self, gate: FlowGate, key: int, endpoints: frozenset[str] | None = None) -> None:
        self._gate, self.key, self.endpoints = gate, key, endpoints

    def restrict(self, candidates: Sequence[EndpointState]) -> Sequence[EndpointState]:
        """Of ``candidates``, those the request was dispatched to fit (all of them when flow
        control named none, or none of those named is a candidate any more)."""
        if self.endpoints is None:
            return candidates
        fitting = [e for e in candidates if e.name in self.endpoints]
        return fitting or candidates

    def routed(self, endpoint: str, state: CycleState, now: float) -> None:
        """The scheduler picked ``endpoint`` (``state``: its cycle's data, for the detectors)."""
        self._gate.controller.routed(self.key, endpoint, state, now)

    def first_token(self) -> None:
        """The first token came back (idempotent): the prompt's prefill booking goes."""
        self._gate.controller.first_token(self.key)
        self._gate.wake()

    def finished(self) -> None:
        """The request is over, however it ended (idempotent): its booking goes, and the
        dispatcher looks again at once."""
        self._gate.released(self.key)


class Admission:
    """A request flow control has taken in: decided at once, or held until the dispatcher
    decides. The holder awaits :meth:`ticket`, or calls :meth:`withdraw` if it gives up first."""

    __slots__ = ("_future", "_gate", "held_s", "key")

    def __init__(
        self, gate: FlowGate, key: int, future: asyncio.Future[Decision], held_s: float | None
    ) -> None:
        self._gate, self.key, self._future = gate, key, future
        self.held_s = held_s
        """The most the request may wait, when it is held (its band's TTL, seconds); None when
        it was dispatched or shed at once."""

    async def ticket(self) -> FlowTicket:
        """Return once the request may be scheduled; raise :class:`RequestShed` if it may not.
        Cancelled (the client hung up, so Envoy reset the stream), the request leaves the queue."""
        try:
            decision = await self._future
        except asyncio.CancelledError:
            self.withdraw()
            raise
        if decision.outcome is not Outcome.DISPATCHED:
            controller = self._gate.controller
            raise RequestShed(
                _SHED_MESSAGES[decision.outcome], retry_after_s=controller.settings.retry_after_s
            )
        return FlowTicket(self._gate, self.key, decision.endpoints)

    def withdraw(self) -> None:
        """The request no longer waits (idempotent): it leaves the queue, or, dispatched in the
        same loop turn, releases its booking."""
        self._gate.withdrawn(self.key)


class FlowGate:
    def __init__(
        self,
        flow_control: FlowControl,
        endpoints: Callable[[], Sequence[EndpointState]],
        clock: Callable[[], float],
        metrics: FlowMetrics | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        """``on_queued`` is called whenever a request has to wait (the pool looked saturated)."""
        self.flow_control = flow_control
        self.on_queued = on_queued
        self.controller = flow_control.controller
        self.endpoints = endpoints
        self.clock = clock
        self.metrics = metrics
        self._waiters: dict[int, asyncio.Future[Decision]] = {}
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None

    def admit(self, request: LLMRequest, received_at: float) -> Admission:
        """Queue ``request``: flow control dispatches or sheds it at once, or holds it (then
        :attr:`Admission.held_s` says for at most how long). Await :meth:`Admission.ticket`."""
        item = self.flow_control.flow_request(request, received_at)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[item.key] = future
        now = self.clock()
        self._settle(self.controller.enqueue(item, now))
        self._settle(self.controller.poll(now, self.endpoints()))
        held_s = None
        if not future.done():
            if self.on_queued is not None:
                self.on_queued()
            self._ensure_dispatcher()
            held_s = self.controller.settings.limits(item.band).ttl_s
        return Admission(self, item.key, future, held_s)

    def share_load(self, sync: ReplicaSyncState) -> None:
        """Count the peers' synced token load too (:class:`PeerTokenLoad`, which see for the
        errors), and look again at once when a peer's load goes down."""
        self.controller.peers = PeerTokenLoad(sync)
        sync.on_peer_freed = self.wake

    def withdrawn(self, key: int) -> None:
        self._waiters.pop(key, None)
        cancelled = self.controller.cancel(key, self.clock())
        if cancelled is not None:
            self._record(cancelled)
        else:  # dispatched in the same loop turn as the hang-up (or answered): release its booking
            self.controller.finished(key)

    def released(self, key: int) -> None:
        self.controller.finished(key)
        self.wake()

    def wake(self) -> None:
        """Bookings went down: the dispatcher looks again at once (when anything waits)."""
        if len(self.controller):
            self._wake.set()

    def _settle(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            self._record(decision)
            future = self._waiters.pop(decision.request.key, None)
            if future is not None and not future.done():
                future.set_result(decision)

    def _record(self, decision: Decision) -> None:
        if self.metrics is not None:
            self.metrics.record(decision)

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch(), name="flow-control-dispatcher")

    async def _dispatch(self) -> None:
        interval = self.flow_control.spec.poll_interval_ms / 1e3
        while len(self.controller):
            timeout = interval
            expiry = self.controller.next_expiry()
            if expiry is not None:
                timeout = max(0.0, min(timeout, expiry - self.clock()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._settle(self.controller.poll(self.clock(), self.endpoints()))

    async def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
