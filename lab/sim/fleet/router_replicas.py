"""K active-active EPP replicas as one simulator router, synced (or not) with a virtual-time delay.

Envoy spreads new ext_proc streams round-robin over the healthy EPP replicas
(``sim.envoy_config.with_epp_replicas``), so request i goes to replica i mod K, and every
lifecycle call of a request goes to the replica that routed it. Each replica runs its own
pipeline built from the same EndpointPickerConfig (own token load, own approximate prefix index,
own running TPOT SLOs, own RNG), and all of them ask one latency predictor, as live replicas share
the predictor sidecars.

With a sync delay ``d`` every replica has a :class:`~epp.sync.state.ReplicaSyncState` hooked into
its request lifecycle (``epp.sync.hook``); the bytes its ``take_messages()`` hands out at time t are
given to every peer's ``receive()`` at t + d, in the order they were sent, so the peers' deltas go
through the same decode and apply code as the live EPP. Messages are taken after every lifecycle
step (the live transport takes at most every ``SyncTuning.publish_interval_s``, 5 ms, which a
delay d + 5 ms bounds); decode progress is flushed every ``SyncTuning.progress_interval_s``.
Snapshots a replica asks for are served in process at once.
Without a delay (``None``) the replicas never exchange anything: each routes on its own bookings
and the engine metrics alone.

Delivery is lazy: messages due by time t are applied when the next decision at or after t is
taken (:meth:`ReplicatedRouter.catch_up`), which is when a replica first reads them. Live
replicas heartbeat from their start, so they know each other before a pool takes traffic; here
every replica hears each peer's first heartbeat at construction. No replica fails in the
simulator, so there are no later heartbeats and no expiry: an idle stretch of virtual time has no
events to carry heartbeats, and expiring on it would drop bookings no live replica would.
Every replica reads the engine gauges of the same scrape ticks (``FleetConfig.scrape_interval_s``),
unless they share scrapes (``share_scrapes``, ``epp.sync.scrape_share``): then each engine has one
owner among the replicas (rendezvous hashing on the replicas' and engines' names, as live), which
reads each scrape at its tick, while the others read it ``scrape_lag_s`` later: the owner's
batching, a fixed phase within ``scrape_batch_s`` per engine (live, the owner publishes at most
once per fast tick, and each engine's poller keeps its own phase), plus the sync delay. No replica
fails here, so no fallback scrape happens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from epp.sync.hook import attach_replica_sync, sync_targets
from epp.sync.scrape_owners import owner, weight
from epp.sync.state import ReplicaSyncState, SyncTuning
from sim.fleet.predictor import InProcessPredictor
from sim.fleet.replica import Replica
from sim.fleet.routers import EPOCH, PipelineRouter, Router, RoutingCall


class ReplicatedRouter(Router):
    def __init__(
        self,
        config: str,
        clock: Callable[[], float],
        seed: int,
        *,
        replicas: int,
        sync_delay_s: float | None,
        name: str | None = None,
        tuning: SyncTuning | None = None,
        share_scrapes: bool = False,
        scrape_batch_s: float = 0.05,
    ) -> None:
        """``replicas`` EPP replicas of ``config``; replica k's RNG is seeded ``seed + k``.
        ``sync_delay_s``: virtual seconds from a replica's publishing to its peers' applying, or
        None for replicas that never sync. ``share_scrapes`` (synced replicas only): see the module."""
        if replicas < 1:
            raise ValueError("a router needs at least one replica")
        if sync_delay_s is not None and sync_delay_s < 0:
            raise ValueError("the sync delay cannot be negative")
        if share_scrapes and sync_delay_s is None:
            raise ValueError("replicas share scrapes over sync: give a sync delay")
        self.share_scrapes = share_scrapes and replicas > 1
        self.scrape_batch_s = scrape_batch_s
        self.name = name or config
        self.clock = clock
        self.sync_delay_s = sync_delay_s
        self.tuning = tuning or SyncTuning()
        self.predictor = InProcessPredictor(seed=seed)
        self.members = [
            PipelineRouter(config, clock, seed + k, name=self.name, predictor=self.predictor)
            for k in range(replicas)
        ]
        self.sync: list[ReplicaSyncState] = []
        if sync_delay_s is not None:
            for k, member in enumerate(self.members):
                state = ReplicaSyncState(
                    f"epp-{k}",
                    sync_targets(member.pipeline),
                    clock=clock,
                    wall_clock=lambda: EPOCH + clock(),
                    tuning=self.tuning,
                    incarnation=1,
                )
                attach_replica_sync(member.lifecycle, state)
                self.sync.append(state)
        for sender in self.sync:
            beat = sender.heartbeat()
            for state in self.sync:
                if state is not sender:
                    state.receive(beat)
        self._by_id = {state.replica_id: state for state in self.sync}
        self.wants_progress = any(member.lifecycle.wants_progress for member in self.members)
        self._turn = 0
        self._owner: dict[str, int] = {}
        self._wire: list[tuple[float, int, int, bytes]] = []
        """Messages on their way: (due, order sent, sender, data)."""
        self._sent = 0
        self._next_flush = 0.0

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        index = self._turn
        self._turn = (index + 1) % len(self.members)
        return self.route_on(index, call, replicas, now)

    def route_on(self, index: int, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        """Route ``call`` on member ``index`` (the replica its ext_proc stream went to)."""
        self.catch_up(now)
        if self.share_scrapes:
            chosen = self._route_on_shared_scrapes(index, call, replicas, now)
        else:
            chosen = self.members[index].route(call, replicas, now)
        self._owner[call.request.request_id] = index
        self._publish(index, now)
        return chosen

    def _route_on_shared_scrapes(
        self, index: int, call: RoutingCall, replicas: Sequence[Replica], now: float
    ) -> Replica:
        """Member ``index`` routes on its own scrapes of the engines it owns and on the owners'
        shared ones, as late as they reach it, of the others (swapped in for the decision)."""
        me = self.sync[index].replica_id
        live = [replica.state.metrics for replica in replicas]
        for replica in replicas:
            if self._scrape_owner(replica.name) != me:
                replica.state.metrics = replica.shared_metrics(now)
        try:
            return self.members[index].route(call, replicas, now)
        finally:
            for replica, metrics in zip(replicas, live, strict=True):
                replica.state.metrics = metrics

    def _scrape_owner(self, endpoint: str) -> str:
        return owner(endpoint, [state.replica_id for state in self.sync])

    def scrape_lag_s(self, endpoint: str) -> float | None:
        if not self.share_scrapes:
            return None
        phase = weight(self._scrape_owner(endpoint), endpoint) % 1_000 / 1_000
        return phase * self.scrape_batch_s + (self.sync_delay_s or 0.0)

    def on_first_token(self, call: RoutingCall, now: float) -> None:
        index = self._owner[call.request.request_id]
        self.members[index].on_first_token(call, now)
        self._publish(index, now)

    def on_progress(self, call: RoutingCall, tokens: int, now: float) -> None:
        self.members[self._owner[call.request.request_id]].on_progress(call, tokens, now)

    def on_finished(self, call: RoutingCall, now: float, *, completed: bool, completion_tokens: int) -> None:
        index = self._owner.pop(call.request.request_id)
        self.members[index].on_finished(call, now, completed=completed, completion_tokens=completion_tokens)
        self._publish(index, now)

    def tick(self, now: float) -> None:
        self.members[0].tick(now)  # the shared predictor retrains once

    def predicted(self, call: RoutingCall) -> tuple[float, float] | None:
        index = self._owner.get(call.request.request_id)
        return None if index is None else self.members[index].predicted(call)

    def close(self) -> None:
        self.predictor.close()

    def catch_up(self, now: float) -> None:
        """Publish the decode progress due by ``now`` and apply every message due by then."""
        if not self.sync:
            return
        interval = self.tuning.progress_interval_s
        if now >= self._next_flush:
            for index, state in enumerate(self.sync):
                state.flush()
                self._publish(index, now)
            self._next_flush = (math.floor(now / interval) + 1) * interval
        wire = self._wire
        while wire and wire[0][0] <= now:
            _, _, sender, data = heapq.heappop(wire)
            for index, state in enumerate(self.sync):
                if index != sender:
                    state.receive(data)
        for state in self.sync:
            for peer in state.wanted_snapshots():
                reply = self._by_id[peer].answer(state.snapshot_request())
                if reply is None or state.receive(reply) is None:
                    state.snapshot_failed(peer)

    def _publish(self, index: int, now: float) -> None:
        if not self.sync:
            return
        due = now + self.sync_delay_s  # type: ignore[operator]  (set whenever self.sync is)
        for data in self.sync[index].take_messages():
            self._sent += 1
            heapq.heappush(self._wire, (due, self._sent, index, data))
