"""``foresee``: a request's latencies on a copy of its replica that nothing later reaches."""

from __future__ import annotations

import pytest

from sim.engine import EngineRequest
from sim.fleet import FleetConfig, FleetSimulator, Session, Turn, Workload, make_router
from sim.fleet.clairvoyant import Foreseen, foresee
from sim.fleet.replica import Replica
from sim.fleet.simulator import SimulatedRequest


def _foreseen_run(sessions: list[Session]) -> tuple[list[SimulatedRequest], dict[str, Foreseen | None]]:
    foreseen: dict[str, Foreseen | None] = {}

    def on_routed(record: SimulatedRequest, replica: Replica, request: EngineRequest, delay_s: float) -> None:
        foreseen[record.request_id] = foresee(replica, request, delay_s)

    config = FleetConfig(replicas=1, profile="llama-3.1-8b-h100")
    simulator = FleetSimulator(
        Workload("t", sessions), lambda clock: make_router("round-robin", clock, 0), config, on_routed
    )
    return simulator.run().records, foreseen


def test_with_nothing_arriving_later_the_copy_is_exact() -> None:
    """Each request arrives after the one before it finished: what happened is what the copy,
    which sees the same engine state and no later arrival, runs."""
    sessions = [Session(f"s{i}", 10.0 * i, (Turn(2000 + 500 * i, 40),)) for i in range(3)]
    records, foreseen = _foreseen_run(sessions)
    for record in records:
        seen = foreseen[record.request_id]
        assert seen is not None
        assert seen.ttft_s == pytest.approx(record.ttft, rel=1e-9)
        assert seen.tpot_s == pytest.approx(record.tpot, rel=1e-9)


def test_later_arrivals_are_what_the_copy_cannot_see() -> None:
    """A long answer, then prompts that arrive while it decodes: their prefills lengthen its
    steps, so it decodes slower than its copy said; the copies of the later ones see it."""
    sessions = [Session("long", 0.0, (Turn(500, 400),))]
    sessions += [Session(f"p{i}", 0.5 + 0.2 * i, (Turn(6000, 2),)) for i in range(5)]
    records, foreseen = _foreseen_run(sessions)
    long = next(r for r in records if r.session_id == "long")
    seen = foreseen[long.request_id]
    assert seen is not None and seen.tpot_s is not None and long.tpot is not None
    assert seen.ttft_s == pytest.approx(long.ttft, rel=1e-9)
    assert long.tpot > 1.2 * seen.tpot_s
    first_prompt = next(r for r in records if r.session_id == "p0")
    assert foreseen[first_prompt.request_id].ttft_s == pytest.approx(first_prompt.ttft, rel=1e-9)  # type: ignore[union-attr]


def test_a_refused_request_is_not_foreseen_and_nothing_is_changed() -> None:
    sessions = [Session("huge", 0.0, (Turn(200_000, 5),)), Session("ok", 1.0, (Turn(100, 5),))]
    records, foreseen = _foreseen_run(sessions)
    assert foreseen[records[0].request_id] is None and records[0].rejected == "engine_refused"
    assert foreseen[records[1].request_id] is not None and records[1].completed
