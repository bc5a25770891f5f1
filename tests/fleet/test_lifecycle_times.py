"""The fleet simulator hands the request lifecycle the engine's event times, not the time it synced to."""

from __future__ import annotations

import random

import pytest

from epp.scheduling.framework import RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from sim.fleet import FleetConfig, FleetSimulator, Session, Turn, Workload, make_router
from sim.fleet.routers import PipelineRouter


class _Recorder(LifecycleObserver):
    """What the lifecycle observers heard, and what the router's clock read meanwhile."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.first_tokens: dict[str, tuple[float, float]] = {}
        self.outcomes: dict[str, tuple[RequestOutcome, float]] = {}
        self.readings: list[float] = []
        """The clock at every step, in the order the steps were heard."""

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        assert now == self.clock()
        self.readings.append(now)

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        self.first_tokens[routed.request.request_id] = (now, self.clock())
        self.readings.append(now)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self.outcomes[routed.request.request_id] = (outcome, self.clock())
        self.readings.append(outcome.finished_at)


def _mixed_workload(seed: int) -> Workload:
    """Open-loop single requests (their arrivals make the loop sync past engine events),
    closed-loop sessions whose later turns wait a think time after the previous turn finished,
    and sessions that start when every session of a group has ended (as RL steps do)."""
    rng = random.Random(seed)
    sessions = [
        Session(f"open{i}", rng.uniform(0, 8), (Turn(rng.randint(100, 2000), rng.randint(1, 200)),))
        for i in range(40)
    ]
    for i in range(8):
        turns = [Turn(rng.randint(200, 1500), rng.randint(5, 150))]
        turns += [
            Turn(1500 + 300 * k, rng.randint(5, 150), prefix="previous", think_s=rng.uniform(0.2, 1.5))
            for k in range(1, 4)
        ]
        sessions.append(Session(f"closed{i}", rng.uniform(0, 3), tuple(turns)))
    for i in range(3):
        turn = Turn(rng.randint(200, 1500), rng.randint(5, 150))
        sessions.append(Session(f"step0-{i}", rng.uniform(0, 1), (turn,), group="step0"))
        sessions.append(Session(f"step1-{i}", 0.0, (turn,), group="step1", after="step0"))
    return Workload("mixed", sessions)


@pytest.mark.parametrize("router", ["gie-default", "predicted-latency"])
def test_outcomes_and_think_times_use_the_engines_event_times(router: str) -> None:
    recorders: list[_Recorder] = []

    def factory(clock):
        routing = make_router(router, clock, 3)
        assert isinstance(routing, PipelineRouter)
        recorders.append(_Recorder(clock))
        routing.lifecycle.add_observer(recorders[0])
        return routing

    workload = _mixed_workload(4)
    result = FleetSimulator(workload, factory, FleetConfig(replicas=2, sample_interval_s=0.5)).run()
    (recorder,) = recorders
    completed = [r for r in result.records if r.completed]
    assert len(completed) == len(result.records) == sum(len(s.turns) for s in workload.sessions)
    assert recorder.readings == sorted(recorder.readings)  # the router's time never runs back
    for record in completed:
        outcome, clock_at_finish = recorder.outcomes[record.request_id]
        first_token, clock_at_first = recorder.first_tokens[record.request_id]
        # record.first_token and record.finish are the engine's step-end times for the request.
        assert outcome.received_at == record.arrival
        assert outcome.first_token_at == first_token == clock_at_first == record.first_token
        assert outcome.finished_at == clock_at_finish == record.finish
        assert outcome.completion_tokens == record.output_tokens
    by_id = {r.request_id: r for r in result.records}
    thinks = 0
    for session in workload.sessions:
        for index, turn in enumerate(session.turns[1:], start=1):
            previous = by_id[f"{session.session_id}#{index - 1}"]
            assert by_id[f"{session.session_id}#{index}"].arrival == pytest.approx(
                previous.finish + turn.think_s, abs=1e-9
            )
            thinks += 1
    assert thinks == 24
    step0_end = max(by_id[f"step0-{i}#0"].finish for i in range(3))
    assert [by_id[f"step1-{i}#0"].arrival for i in range(3)] == [step0_end] * 3
