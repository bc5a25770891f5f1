"""Flow control in the fleet simulator: the same controller as the live EPP, driven in virtual time.

The simulator asks :meth:`FleetFlowGate.admit` before it routes an arrival: the request goes on
at once, is shed at once (a full queue), or is held and comes back from :meth:`FleetFlowGate.poll`
(dispatched, or shed when it expired or was pushed out), which the simulator calls after every
event and, while requests are held, every ``pollIntervalMs`` of virtual time (the live
dispatcher's cadence). :class:`FlowControlledRouter` wraps the config's own router and tells the
controller where each dispatched request went and when it finished, as the live director's
ticket does.

With K EPP replicas (:class:`~sim.fleet.router_replicas.ReplicatedRouter`) each has its own
controller, as live replicas do: request i waits at replica i mod K (Envoy's round-robin over
ext_proc streams) and is routed there (:class:`ReplicatedFlowGate`). With ``pool_wide`` token
load, each controller's token-load detector also counts its peers' in-flight tokens as the
replica's sync state applied them (:class:`~epp.flowcontrol.peers.PeerTokenLoad`, as the live
EPP does), that is, as of the sync delay ago; without it, each counts only its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.configs import config_path
from epp.flowcontrol.config import FlowControl, build_flow_control
from epp.flowcontrol.peers import PeerTokenLoad
from epp.flowcontrol.types import Decision, Outcome
from epp.scheduling.config import EndpointPickerConfig
from epp.scheduling.types import EndpointState
from sim.fleet.replica import Replica
from sim.fleet.router_replicas import ReplicatedRouter
from sim.fleet.routers import PipelineRouter, Router, RoutingCall, RoutingRejected


@dataclass(slots=True)
class Released:
    """Held requests' payloads that left the queue: ``dispatched`` go on to routing, ``shed`` are
    answered 429 (with a reason: ``flow_expired``, ``flow_rejected``, ``flow_evicted``)."""

    dispatched: list[Any] = field(default_factory=list)
    shed: list[tuple[Any, str]] = field(default_factory=list)


def shed_reason(outcome: Outcome) -> str:
    return f"flow_{outcome.value}"


class FleetFlowGate:
    def __init__(self, flow_control: FlowControl) -> None:
        self.flow_control = flow_control
        self.controller = flow_control.controller
        self.poll_interval_s = flow_control.spec.poll_interval_ms / 1e3
        self.keys: dict[str, int] = {}
        """Request id → flow-control key, from admission to finish."""
        self._held: dict[int, tuple[str, Any]] = {}
        self._released = Released()
        self.queue_time_s: dict[str, float] = {}
        """Per request id, how long it waited in flow control (0 when dispatched at once)."""
        self._fitting: dict[str, frozenset[str]] = {}
        """Per dispatched request id not routed yet, the endpoints flow control said it fits."""

    def __len__(self) -> int:
        return len(self.controller)

    def admit(
        self, call: RoutingCall, payload: Any, replicas: Sequence[Replica], now: float
    ) -> Outcome | None:
        """DISPATCHED: route ``call`` now. None: held (``payload`` comes back from :meth:`poll`).
        Any other outcome: shed at once."""
        request_id = call.request.request_id
        item = self.flow_control.flow_request(call.request, now)
        self.keys[request_id] = item.key
        self._held[item.key] = (request_id, payload)
        decisions = self.controller.enqueue(item, now) + self.controller.poll(now, _states(replicas))
        return self._settle(decisions, own=item.key)

    def poll(self, now: float, replicas: Sequence[Replica]) -> Released:
        """What left the queue since the last call."""
        self._settle(self.controller.poll(now, _states(replicas)))
        released, self._released = self._released, Released()
        return released

    def restrict(self, request_id: str, replicas: Sequence[Replica]) -> Sequence[Replica]:
        """Of ``replicas``, those dispatched request ``request_id`` fits (as the live ticket's
        ``restrict``)."""
        fitting = self._fitting.pop(request_id, None)
        if fitting is None:
            return replicas
        return [r for r in replicas if r.name in fitting] or replicas

    def routed(self, request_id: str, endpoint: str, call: RoutingCall, now: float) -> None:
        key = self.keys.get(request_id)
        if key is not None and call.routed is not None:
            self.controller.routed(key, endpoint, call.routed.state, now)

    def first_token(self, request_id: str) -> None:
        key = self.keys.get(request_id)
        if key is not None:
            self.controller.first_token(key)

    def finished(self, request_id: str) -> None:
        self._fitting.pop(request_id, None)
        key = self.keys.pop(request_id, None)
        if key is not None:
            self.controller.finished(key)

    def _settle(self, decisions: list[Decision], own: int | None = None) -> Outcome | None:
        """Hand each decision's payload to the next :meth:`poll`, except request ``own``'s, whose
        outcome is returned."""
        own_outcome = None
        for d in decisions:
            request_id, payload = self._held.pop(d.request.key)
            self.queue_time_s[request_id] = d.queue_time_s
            if d.outcome is not Outcome.DISPATCHED:
                del self.keys[request_id]
            elif d.endpoints is not None:
                self._fitting[request_id] = d.endpoints
            if d.request.key == own:
                own_outcome = d.outcome
            elif d.outcome is Outcome.DISPATCHED:
                self._released.dispatched.append(payload)
            else:
                self._released.shed.append((payload, shed_reason(d.outcome)))
        return own_outcome


def _states(replicas: Sequence[Replica]) -> list[EndpointState]:
    return [replica.state for replica in replicas]


class FlowControlledRouter(Router):
    """A pipeline router behind flow control: the simulator holds requests at its ``flow_gate``."""

    def __init__(self, inner: PipelineRouter, flow_control: FlowControl) -> None:
        self.inner = inner
        self.name = inner.name
        self.wants_progress = inner.wants_progress
        self.flow_gate = FleetFlowGate(flow_control)

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        request_id = call.request.request_id
        replicas = self.flow_gate.restrict(request_id, replicas)
        try:
            replica = self._route_inner(call, replicas, now)
        except RoutingRejected:
            self.flow_gate.finished(request_id)
            raise
        self.flow_gate.routed(request_id, replica.name, call, now)
        return replica

    def _route_inner(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        return self.inner.route(call, replicas, now)

    def on_first_token(self, call: RoutingCall, now: float) -> None:
        self.inner.on_first_token(call, now)
        self.flow_gate.first_token(call.request.request_id)

    def on_progress(self, call: RoutingCall, tokens: int, now: float) -> None:
        self.inner.on_progress(call, tokens, now)

    def on_finished(self, call: RoutingCall, now: float, *, completed: bool, completion_tokens: int) -> None:
        self.inner.on_finished(call, now, completed=completed, completion_tokens=completion_tokens)
        self.flow_gate.finished(call.request.request_id)

    def tick(self, now: float) -> None:
        self.inner.tick(now)

    def predicted(self, call: RoutingCall) -> tuple[float, float] | None:
        return self.inner.predicted(call)

    def close(self) -> None:
        self.inner.close()

    @property
    def predictor(self) -> Any:
        """The inner router's latency predictor (the simulator reports its retrains)."""
        return self.inner.predictor


class ReplicatedFlowGate:
    """K replicas' gates behind the simulator's one (see the module): the same calls as
    :class:`FleetFlowGate`, each passed to the gate of the replica the request went to."""

    def __init__(
        self, router: ReplicatedRouter, flow_controls: Sequence[FlowControl], *, pool_wide: bool
    ) -> None:
        self.router = router
        self.gates = [FleetFlowGate(fc) for fc in flow_controls]
        self.poll_interval_s = self.gates[0].poll_interval_s
        self.pool_wide = pool_wide
        if pool_wide:
            for gate, sync in zip(self.gates, router.sync, strict=True):
                gate.controller.peers = PeerTokenLoad(sync)
        self._turn = 0
        self._first = 0
        self.member: dict[str, int] = {}
        """Request id → the replica it went to, from admission to finish."""

    def __len__(self) -> int:
        return sum(len(gate) for gate in self.gates)

    @property
    def queue_time_s(self) -> dict[str, float]:
        return {rid: s for gate in self.gates for rid, s in gate.queue_time_s.items()}

    def admit(
        self, call: RoutingCall, payload: Any, replicas: Sequence[Replica], now: float
    ) -> Outcome | None:
        index = self._turn
        self._turn = (index + 1) % len(self.gates)
        self.member[call.request.request_id] = index
        self._catch_up(now)
        outcome = self.gates[index].admit(call, payload, replicas, now)
        if outcome is not None and outcome is not Outcome.DISPATCHED:
            del self.member[call.request.request_id]
        return outcome

    def poll(self, now: float, replicas: Sequence[Replica]) -> Released:
        """Each replica's releases; the replica that looks first takes the room that freed up, so
        the first is another one at each call (live replicas' dispatchers race; none always wins)."""
        released = Released()
        k = len(self.gates)
        self._first = (self._first + 1) % k
        self._catch_up(now)
        for index in [(self._first + i) % k for i in range(k)]:
            mine = self.gates[index].poll(now, replicas)
            released.dispatched += mine.dispatched
            released.shed += mine.shed
        for (_, _, call, *_), _ in released.shed:
            del self.member[call.request.request_id]
        return released

    def restrict(self, request_id: str, replicas: Sequence[Replica]) -> Sequence[Replica]:
        return self.gates[self.member[request_id]].restrict(request_id, replicas)

    def routed(self, request_id: str, endpoint: str, call: RoutingCall, now: float) -> None:
        self.gates[self.member[request_id]].routed(request_id, endpoint, call, now)

    def first_token(self, request_id: str) -> None:
        self.gates[self.member[request_id]].first_token(request_id)

    def finished(self, request_id: str) -> None:
        index = self.member.pop(request_id, None)
        if index is not None:
            self.gates[index].finished(request_id)

    def _catch_up(self, now: float) -> None:
        """Deliver the sync messages due by ``now``: the controllers read their peers' tokens as
        synced by then."""
        if self.pool_wide:
            self.router.catch_up(now)


class FlowControlledReplicas(FlowControlledRouter):
    """K EPP replicas, each behind its own flow control (see the module)."""

    def __init__(
        self, inner: ReplicatedRouter, flow_controls: Sequence[FlowControl], *, pool_wide: bool
    ) -> None:
        self.inner = inner  # type: ignore[assignment]
        self.name = inner.name
        self.wants_progress = inner.wants_progress
        self.flow_gate = ReplicatedFlowGate(inner, flow_controls, pool_wide=pool_wide)  # type: ignore[assignment]

    def _route_inner(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        index = self.flow_gate.member[call.request.request_id]  # type: ignore[attr-defined]
        return self.inner.route_on(index, call, replicas, now)  # type: ignore[attr-defined]


def flow_controlled_replicas(
    config: str,
    clock: Callable[[], float],
    seed: int,
    *,
    replicas: int,
    sync_delay_s: float | None,
    pool_wide: bool,
    name: str | None = None,
) -> Router:
    """``replicas`` EPP replicas of ``config`` (synced with ``sync_delay_s``, or never when None),
    each behind flow control when the config turns it on; ``pool_wide``: their token-load
    detectors count the peers' synced tokens too (needs a sync delay)."""
    if pool_wide and sync_delay_s is None:
        raise ValueError("pool-wide token load needs synced replicas (a sync delay)")
    inner = ReplicatedRouter(
        str(config_path(config)), clock, seed, replicas=replicas, sync_delay_s=sync_delay_s, name=name
    )
    spec = EndpointPickerConfig.from_file(config_path(config))
    controls = [build_flow_control(spec, m.pipeline, m.context) for m in inner.members]
    if any(c is None for c in controls):
        return inner
    return FlowControlledReplicas(inner, controls, pool_wide=pool_wide)  # type: ignore[arg-type]


def flow_controlled_router(
    config: str, clock: Callable[[], float], seed: int, *, name: str | None = None
) -> Router:
    """The router of EndpointPickerConfig ``config`` (a shipped name or a path), behind flow
    control when the config turns it on."""
    inner = PipelineRouter(str(config_path(config)), clock, seed, name=name or config)
    spec = EndpointPickerConfig.from_file(config_path(config))
    flow_control = build_flow_control(spec, inner.pipeline, inner.context)
    return inner if flow_control is None else FlowControlledRouter(inner, flow_control)
