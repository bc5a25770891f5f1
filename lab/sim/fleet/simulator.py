"""The fleet simulator's discrete-event loop: arrivals, routing, engine steps, lifecycle, in virtual time.

Events on the heap are arrivals (a session's turn), requests reaching an engine after the
front end's delay, samples of the fleet's load (every ``sample_interval_s``) and retraining
ticks (every ``retrain_interval_s``). Engine steps are not events: before handling an event at
time ``t`` every replica completes the steps that end by ``t`` (``Replica.advance``), and the
first tokens and finishes they produced are handed to the router in time order, as the live
director would (token load, training samples), each at the engine's event time, not the time
the loop synced to. Closed-loop sessions create arrivals when a turn finishes (its think time
counts from the finish), so the loop never jumps past the earliest time any engine could finish a
request plus the shortest think time.

The simulator only drives time: the request lifecycle around routing (bookings, observers,
outcomes) is the router's, the same one the live director drives
(``epp.requestcontrol.lifecycle``).

The EPP sees each engine as its metrics scraper would: the gauges (queue, batch, KV usage) as
they were at the last scrape tick (every ``scrape_interval_s``) before the decision, and its own
token-load bookkeeping as of the decision. Everything is deterministic given the workload and
the seed; the only wall-clock reading is the router's decision time, which is reported, never
used.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from epp.flowcontrol.types import Outcome
from epp.latency.drift import DriftEvent
from epp.requestcontrol.request_headers import EXPECTED_OUTPUT_HEADER
from epp.scheduling.types import ApiKind, LLMRequest
from sim.engine import EngineRequest, Profile, RequestOutput, RequestRejectedError, load_profile
from sim.engine.pool import pool_profiles
from sim.fleet.estimated import TokenText
from sim.fleet.flow_gate import FleetFlowGate, shed_reason
from sim.fleet.prompts import PromptBuilder, turn_key
from sim.fleet.replica import Replica
from sim.fleet.routers import Router, RoutingCall, RoutingRejected
from sim.fleet.workload import Session, Workload, session_headers

_ARRIVAL, _ENGINE_ADD, _SAMPLE, _RETRAIN, _FLOW, _SWITCH = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class ProfileSwitch:
    """At ``at_s`` every engine's step costs become ``profile``'s (default: each engine's own)
    times ``slowdown``: the engines change speed mid-run, and the latency model goes stale."""

    at_s: float
    profile: str | None = None
    slowdown: float = 1.0


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 4
    profile: str = "llama-3.1-8b-h100"
    """The pool (``sim.engine.pool``): a profile every replica runs, or ``NAME:COUNT,...`` whose
    counts sum to ``replicas``."""
    scrape_interval_s: float = 0.05
    sample_interval_s: float = 0.5
    retrain_interval_s: float = 10.0
    seed: int = 0
    switches: tuple[ProfileSwitch, ...] = ()
    estimated_bytes_per_token: float | None = None
    """Route on token ids estimated from the prompts' text, as an EPP without the model's
    tokenizer does, for text of this many bytes a token (``sim.fleet.estimated``); None: exact."""
    estimate_calibrated: bool = False
    """The estimate runs at the text's bytes a token, as an EPP sampling the model's tokenizer
    (``--tokenize-every``) does once calibrated, instead of 4."""
    joins_at_s: tuple[float, ...] = ()
    """When the last ``len(joins_at_s)`` replicas join the pool, in order (virtual seconds); until
    then the router is not offered them (a replica scaled out into a warm pool)."""
    output_hint_sigma: float | None = None
    """The client sends ``x-expected-output-tokens``: each turn's true output length times
    exp(N(0, sigma)), drawn per request from the seed (0: the exact length, the most a hint can
    tell); None: no hint."""


@dataclass(slots=True)
class SimulatedRequest:
    """One request's life; times are virtual seconds."""

    request_id: str
    session_id: str
    group: str
    turn: int
    arrival: float
    input_tokens: int
    output_tokens: int
    replica: int = -1
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: int = 0
    rejected: str | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    decision_s: float = 0.0
    """Wall-clock seconds the router took to decide."""

    @property
    def completed(self) -> bool:
        return self.finish is not None and self.rejected is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


RoutedHook = Callable[[SimulatedRequest, Replica, EngineRequest, float], None]
"""Called as each request is routed, before it leaves for the replica: its record, the replica,
the engine request (not yet in the front end or the engine; ``arrival_time`` is now) and its
front-end delay in seconds. For measurements that look at the state at the decision."""


@dataclass(slots=True)
class FleetResult:
    router: str
    profile: Profile
    """The first replica's profile (every replica's in a homogeneous pool)."""
    config: FleetConfig
    records: list[SimulatedRequest]
    sample_times: list[float]
    active_decode_blocks: list[list[int]]
    """Per sample, each replica's KV blocks held by decoding requests."""
    in_flight: list[int]
    """Per sample, requests routed and not finished, fleet-wide."""
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    virtual_s: float
    wall_s: float
    retrains: int
    drift_events: list[DriftEvent] = field(default_factory=list)
    """When the router's latency model started and stopped drifting (virtual seconds)."""
    replica_profiles: list[str] = field(default_factory=list)
    """Each replica's profile name (with its overrides), by replica index."""


@dataclass(slots=True)
class _SessionState:
    session: Session
    keeps_history: bool
    """Some later turn extends the previous one, so the last sequence is kept."""
    next_turn: int = 0
    tokens: np.ndarray | None = None
    digests: list[bytes] = field(default_factory=list)

    def remember(self, tokens: list[int], digests: list[bytes]) -> None:
        if self.keeps_history:
            self.tokens, self.digests = np.asarray(tokens, dtype=np.int64), digests


@dataclass(slots=True)
class _InFlight:
    record: SimulatedRequest
    call: RoutingCall
    replica: Replica
    session: _SessionState
    engine_request: EngineRequest


class FleetSimulator:
    def __init__(
        self,
        workload: Workload,
        router_factory: Callable[[Callable[[], float]], Router],
        config: FleetConfig = FleetConfig(),
        on_routed: RoutedHook | None = None,
    ) -> None:
        self.workload = workload
        self.config = config
        self._on_routed = on_routed
        self.profiles = pool_profiles(config.profile, config.replicas)
        if len(config.joins_at_s) >= config.replicas:
            raise ValueError("joins_at_s: at least one replica must be there from the start")
        self.profile = self.profiles[0]
        self.now = 0.0
        self.router = router_factory(lambda: self.now)
        self.replicas = [Replica(index, profile) for index, profile in enumerate(self.profiles)]
        for replica in self.replicas:
            replica.shared_lag_s = self.router.scrape_lag_s(replica.name)
        self._every_tick = any(replica.shared_lag_s is not None for replica in self.replicas)
        """Scrape sharing: replicas read older scrapes than the last, so every tick is scraped."""
        self.prompts = PromptBuilder(self.profile.engine.block_size, workload.hash_block_tokens)
        estimated = config.estimated_bytes_per_token
        self._router_ids: Callable[[list[int]], list[int]] | None = (
            None if estimated is None else TokenText(estimated, config.estimate_calibrated)
        )
        self.records: list[SimulatedRequest] = []
        self._sessions = [
            _SessionState(session, any(turn.prefix == "previous" for turn in session.turns[1:]))
            for session in workload.sessions
        ]
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._in_flight: dict[str, _InFlight] = {}
        self._pending_arrivals = 0
        self._group_open: dict[str, int] = {}
        self._waiting_for: dict[str, list[_SessionState]] = {}
        self._scraped_at = -math.inf
        self._lifecycle: list[tuple[float, int, int, RequestOutput]] = []
        self._sample_times: list[float] = []
        self._active_blocks: list[list[int]] = []
        self._in_flight_samples: list[int] = []
        self._min_think = workload.min_think_s
        self._flow_tick = False

    def run(self, on_request_done: Callable[[], None] = lambda: None) -> FleetResult:
        """Replay the whole workload; ``on_request_done`` is called as each request ends (progress)."""
        started = time.perf_counter()
        self._on_done = on_request_done
        for state in self._sessions:
            session = state.session
            if not session.turns:
                continue
            if session.group:
                self._group_open[session.group] = self._group_open.get(session.group, 0) + 1
            if session.after is None:
                self._push(session.start_s, _ARRIVAL, state)
            else:
                self._waiting_for.setdefault(session.after, []).append(state)
        self._push(self.config.sample_interval_s, _SAMPLE, None)
        self._push(self.config.retrain_interval_s, _RETRAIN, None)
        for switch in self.config.switches:
            self._push(switch.at_s, _SWITCH, switch)
        heap = self._heap
        while heap:
            if self._min_think is not None and self._in_flight:
                bound = min(replica.next_finish_bound() for replica in self.replicas) + self._min_think
                if bound < heap[0][0]:
                    self._sync(bound)
                    continue
            when, _, kind, payload = heapq.heappop(heap)
            if kind == _ARRIVAL:
                self._pending_arrivals -= 1
            if kind in (_SAMPLE, _RETRAIN, _SWITCH) and not self._busy():
                continue
            self._sync(when)
            if kind == _ARRIVAL:
                self._arrive(payload)  # type: ignore[arg-type]
            elif kind == _ENGINE_ADD:
                self._enter_engine(payload)  # type: ignore[arg-type]
            elif kind == _FLOW:
                self._flow_tick = False
            elif kind == _SWITCH:
                self._switch(payload)  # type: ignore[arg-type]
            elif kind == _SAMPLE:
                self._sample()
                self._push(when + self.config.sample_interval_s, _SAMPLE, None)
            else:
                self.router.tick(when)
                self._push(when + self.config.retrain_interval_s, _RETRAIN, None)
            if self.router.flow_gate is not None:
                self._release_held(self.router.flow_gate)
        counters = [replica.engine.counters for replica in self.replicas]
        retrains = getattr(getattr(self.router, "predictor", None), "retrains", 0)
        self.router.close()
        return FleetResult(
            router=self.router.name,
            profile=self.profile,
            config=self.config,
            records=self.records,
            sample_times=self._sample_times,
            active_decode_blocks=self._active_blocks,
            in_flight=self._in_flight_samples,
            prefix_cache_queries=sum(c.prefix_cache_queries for c in counters),
            prefix_cache_hits=sum(c.prefix_cache_hits for c in counters),
            preemptions=sum(c.num_preemptions for c in counters),
            virtual_s=self.now,
            wall_s=time.perf_counter() - started,
            retrains=retrains,
            drift_events=self.router.drift_events(),
            replica_profiles=[profile.name for profile in self.profiles],
        )

    # ------------------------------------------------------------------ time

    def _push(self, when: float, kind: int, payload: object) -> None:
        self._seq += 1
        if kind == _ARRIVAL:
            self._pending_arrivals += 1
        heapq.heappush(self._heap, (when, self._seq, kind, payload))

    def _busy(self) -> bool:
        held = self.router.flow_gate is not None and len(self.router.flow_gate) > 0
        return bool(self._in_flight) or self._pending_arrivals > 0 or held

    def _release_held(self, gate: FleetFlowGate) -> None:
        """Route what flow control dispatched, answer what it shed; look again while any wait."""
        released = gate.poll(self.now, self.replicas)
        for payload in released.dispatched:
            self._route(*payload)
        for (record, state, *_), reason in released.shed:
            self._reject(record, state, reason)
        if len(gate) and not self._flow_tick:
            self._flow_tick = True
            self._push(self.now + gate.poll_interval_s, _FLOW, None)

    def _sync(self, until: float) -> None:
        """Advance every engine to ``until``, scraping at the last tick before it, then hand the
        lifecycle events to the router in time order, each at its own time."""
        interval = self.config.scrape_interval_s
        tick = min(until, math.floor(until / interval) * interval)
        sink = self._collect
        if tick > self._scraped_at:
            ticks = [tick]
            if self._every_tick and self._scraped_at > -math.inf:
                missed = round((tick - self._scraped_at) / interval) - 1
                ticks = [self._scraped_at + i * interval for i in range(1, missed + 1)] + ticks
            for at in ticks:
                for replica in self.replicas:
                    replica.advance(at, sink)
                    replica.scrape(at)
            self._scraped_at = tick
        for replica in self.replicas:
            replica.advance(until, sink)
        if self._lifecycle:
            events, self._lifecycle = self._lifecycle, []
            events.sort(key=lambda event: event[:3])
            for when, _, _, output in events:
                self.now = when  # what the router's clock reads while it hears the event
                self._lifecycle_event(when, output)
        self.now = until

    def _switch(self, switch: ProfileSwitch) -> None:
        named = load_profile(switch.profile) if switch.profile else None
        for replica in self.replicas:
            replica.engine.cost_model = (named or replica.profile).cost.scaled(switch.slowdown)

    def _collect(self, when: float, replica: Replica, output: RequestOutput) -> None:
        self._lifecycle.append((when, replica.index, len(self._lifecycle), output))

    # ------------------------------------------------------------------ requests

    def _arrive(self, state: _SessionState) -> None:
        session, index = state.session, state.next_turn
        turn = session.turns[index]
        state.next_turn += 1
        now = self.now
        key = turn_key(session.session_id, index)
        if turn.prefix == "blocks":
            tokens, digests = self.prompts.blocks(turn.hash_ids, turn.input_tokens)
        elif turn.prefix == "previous" and state.tokens is not None:
            tokens, digests = self.prompts.extend(state.tokens, state.digests, key, turn.input_tokens)
        else:
            tokens, digests = self.prompts.fresh(key, turn.input_tokens)
        request_id = f"{session.session_id}#{index}"
        headers = {"x-session-id": session.session_id, **session_headers(session)}
        hint = None if self.config.output_hint_sigma is None else self._hint(request_id, turn.output_tokens)
        if hint is not None:
            headers[EXPECTED_OUTPUT_HEADER] = str(hint)
        record = SimulatedRequest(
            request_id, session.session_id, session.group, index, now, len(tokens), turn.output_tokens
        )
        self.records.append(record)
        if state.next_turn < len(session.turns) and session.turns[state.next_turn].offset_s is not None:
            self._push(session.start_s + session.turns[state.next_turn].offset_s, _ARRIVAL, state)
        workload = self.workload
        request = LLMRequest(
            request_id=request_id,
            model="fleet",
            api=ApiKind.CHAT,
            prompt_token_ids=tokens if self._router_ids is None else self._router_ids(tokens),
            stream=True,
            max_tokens=workload.max_tokens,
            headers=headers,
            expected_output_tokens=hint,
            slo_ttft_ms=workload.slo_ttft_ms if session.slo_ttft_ms is None else session.slo_ttft_ms,
            slo_tpot_ms=workload.slo_tpot_ms,
            priority=session.priority,
        )
        call = RoutingCall(request, turn.output_tokens, digests)
        payload = (record, state, call, tokens, digests)
        if self.router.flow_gate is not None:
            outcome = self.router.flow_gate.admit(call, payload, self.replicas, now)
            if outcome is None:
                return  # held: _release_held routes or sheds it
            if outcome is not Outcome.DISPATCHED:
                self._reject(record, state, shed_reason(outcome))
                return
        self._route(*payload)

    def _hint(self, request_id: str, output_tokens: int) -> int:
        """The client's guess at ``output_tokens``: the truth times lognormal noise, the same for a
        request whichever router runs (seeded by the seed and the request id)."""
        sigma = self.config.output_hint_sigma or 0.0
        noise = random.Random(f"{self.config.seed}:{request_id}").gauss(0.0, sigma) if sigma else 0.0
        return max(1, round(output_tokens * math.exp(noise)))

    def _route(
        self,
        record: SimulatedRequest,
        state: _SessionState,
        call: RoutingCall,
        tokens: list[int],
        digests: list[bytes],
    ) -> None:
        now, request_id, router = self.now, record.request_id, self.router
        if router.wants_progress:
            self._report_progress()
        started = time.perf_counter()
        try:
            replica = router.route(call, self._joined(now), now)
        except RoutingRejected as refusal:
            record.decision_s = time.perf_counter() - started
            self._reject(record, state, refusal.reason)
            return
        state.remember(tokens, digests)
        record.decision_s = time.perf_counter() - started
        record.replica = replica.index
        predicted = router.predicted(call)
        if predicted is not None:
            record.predicted_ttft_ms, record.predicted_tpot_ms = predicted
        engine_request = EngineRequest(
            request_id, tokens, record.output_tokens, arrival_time=now, prompt_block_hashes=digests
        )
        flight = _InFlight(record, call, replica, state, engine_request)
        self._in_flight[request_id] = flight
        delay = replica.profile.frontend.delay(len(tokens), replica.engine.num_running)
        if self._on_routed is not None:
            self._on_routed(record, replica, engine_request, delay)
        if delay > 0:
            replica.arriving[request_id] = engine_request
            self._push(now + delay, _ENGINE_ADD, flight)
        else:
            self._enter_engine(flight)

    def _joined(self, now: float) -> list[Replica]:
        joins = self.config.joins_at_s
        if not joins:
            return self.replicas
        first_late = len(self.replicas) - len(joins)
        return [r for r in self.replicas if r.index < first_late or joins[r.index - first_late] <= now]

    def _enter_engine(self, flight: _InFlight) -> None:
        now = self.now
        try:
            flight.replica.add(flight.engine_request, now)
        except RequestRejectedError:
            del self._in_flight[flight.record.request_id]
            self.router.on_finished(flight.call, now, completed=False, completion_tokens=0)
            self._reject(flight.record, flight.session, "engine_refused")

    def _reject(self, record: SimulatedRequest, state: _SessionState, reason: str) -> None:
        """The request ended without being served, at the current (event) time."""
        record.rejected = reason
        record.finish = self.now
        self._on_done()
        self._next_turn(state, record.turn, self.now)

    def _lifecycle_event(self, when: float, output: RequestOutput) -> None:
        flight = self._in_flight.get(output.request.request_id)
        if flight is None:
            return
        record = flight.record
        if output.is_first_token:
            record.first_token = when
            record.cached_tokens = max(0, output.request.num_cached_tokens)
            self.router.on_first_token(flight.call, when)
        if output.finish_reason is not None:
            record.finish = when
            del self._in_flight[record.request_id]
            generated = len(flight.engine_request.output_token_ids)
            self.router.on_finished(flight.call, when, completed=True, completion_tokens=generated)
            state = flight.session
            if state.next_turn == record.turn + 1:  # still the session's latest turn
                state.remember(output.request.all_token_ids, output.request.block_hashes)
            self._on_done()
            self._next_turn(state, record.turn, when)

    def _next_turn(self, state: _SessionState, ended: int, when: float) -> None:
        """Turn ``ended`` ended at ``when``: issue the next one if it waits for it (closed loop)."""
        turns = state.session.turns
        if state.next_turn != ended + 1:
            return  # a later turn already arrived (open loop)
        if state.next_turn >= len(turns):
            state.tokens, state.digests = None, []
            self._session_ended(state.session, when)
            return
        turn = turns[state.next_turn]
        if turn.offset_s is None:
            self._push(when + turn.think_s, _ARRIVAL, state)

    def _session_ended(self, session: Session, when: float) -> None:
        """``session`` ended at ``when``: start the sessions that waited for the last of its group."""
        group = session.group
        if not group:
            return
        self._group_open[group] -= 1
        if self._group_open[group] == 0:
            for state in self._waiting_for.pop(group, []):
                self._push(when + state.session.start_s, _ARRIVAL, state)

    def _report_progress(self) -> None:
        """Tell the router how many tokens each decoding request has streamed so far."""
        router, now = self.router, self.now
        for flight in self._in_flight.values():
            generated = len(flight.engine_request.output_token_ids)
            if generated:
                router.on_progress(flight.call, generated, now)

    def _sample(self) -> None:
        self._sample_times.append(self.now)
        self._active_blocks.append([replica.active_decode_blocks() for replica in self.replicas])
        self._in_flight_samples.append(len(self._in_flight))
