"""Flow control in the fleet simulator: the live controller in virtual time. A saturated pool holds
arrivals, releases them highest band first, answers what waits past its TTL, loses nothing; a
config without flow control routes exactly as before; K EPP replicas gate their own requests, counting
their peers' synced tokens when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.fleet import FleetConfig, FleetSimulator, Session, Turn, Workload
from sim.fleet.flow_gate import (
    FlowControlledReplicas,
    FlowControlledRouter,
    flow_controlled_replicas,
    flow_controlled_router,
)
from sim.fleet.routers import PipelineRouter

CONFIG = """
plugins:
- type: queue-scorer
- type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: 1500}
flowControl:
  saturationDetectors: [token-load-saturation-detector]
  defaultOutputTokens: 400
  defaultBand: {ttlSeconds: 30}
  bands:
  - {priority: -1, ttlSeconds: 0.5}
"""


def _simulate(
    tmp_path: Path, sessions: list[Session], config: str = CONFIG, replicas: int = 1
) -> FleetSimulator:
    path = tmp_path / "fc.yaml"
    path.write_text(config)
    simulator = FleetSimulator(
        Workload("t", sessions),
        lambda clock: flow_controlled_router(str(path), clock, 0),
        FleetConfig(replicas=replicas, profile="llama-3.1-8b-h100"),
    )
    simulator.run()
    return simulator


def _one_shot(sid: str, start: float, priority: int = 0, tenant: str = "t") -> Session:
    return Session(sid, start, (Turn(1000, 300),), tenant=tenant, priority=priority)


def test_a_saturated_pool_releases_held_requests_highest_band_first(tmp_path: Path) -> None:
    # Each request books 1400 tokens of a 1500-token pool: one runs at a time.
    sessions = [_one_shot("first", 0.0), _one_shot("low", 0.01), _one_shot("mid", 0.02, priority=1)]
    sessions += [_one_shot("high", 0.03, priority=5)]
    simulator = _simulate(tmp_path, sessions)
    assert isinstance(simulator.router, FlowControlledRouter)
    records = {r.session_id: r for r in simulator.records}
    assert all(r.completed for r in records.values())
    starts = sorted(records, key=lambda sid: records[sid].first_token)  # type: ignore[arg-type, return-value]
    assert starts == ["first", "high", "mid", "low"]
    gate = simulator.router.flow_gate
    assert gate is not None and len(gate) == 0 and gate.controller.booked() == 0
    waited = gate.queue_time_s
    assert waited["first#0"] == 0.0 and waited["low#0"] > waited["mid#0"] > waited["high#0"] > 0


def test_requests_past_their_ttl_are_shed_and_nothing_is_lost(tmp_path: Path) -> None:
    sessions = [_one_shot(f"s{i}", 0.01 * i, priority=-1 if i % 2 else 0) for i in range(12)]
    simulator = _simulate(tmp_path, sessions)
    records = simulator.records
    assert len(records) == 12
    shed = [r for r in records if r.rejected is not None]
    assert shed and all(r.rejected == "flow_expired" for r in shed)
    assert all(r.session_id in {f"s{i}" for i in range(1, 12, 2)} for r in shed)  # only the sheddable band
    assert all(r.completed for r in records if r.rejected is None)
    assert simulator.router.flow_gate.controller.booked() == 0  # type: ignore[union-attr]


def test_a_config_without_flow_control_gets_the_plain_router(tmp_path: Path) -> None:
    simulator = _simulate(tmp_path, [_one_shot("a", 0.0)], config="plugins:\n- type: queue-scorer\n")
    assert type(simulator.router) is PipelineRouter and simulator.router.flow_gate is None
    assert simulator.records[0].completed


def _simulate_replicas(tmp_path: Path, sessions: list[Session], *, pool_wide: bool) -> FleetSimulator:
    path = tmp_path / "fc.yaml"
    path.write_text("plugins:\n- type: token-load-producer\n" + CONFIG.removeprefix("\nplugins:\n"))
    simulator = FleetSimulator(
        Workload("t", sessions),
        lambda clock: flow_controlled_replicas(
            str(path), clock, 0, replicas=2, sync_delay_s=0.001, pool_wide=pool_wide
        ),
        FleetConfig(replicas=1, profile="llama-3.1-8b-h100"),
    )
    simulator.run()
    return simulator


def test_k_replicas_each_gate_their_own_requests_and_pool_wide_load_counts_the_peers(tmp_path: Path) -> None:
    # "first" goes to EPP replica 0, "second" to replica 1: each books 1400 of the engine's 1500
    # tokens. Counting only its own bookings, replica 1 sends "second" at once; counting its
    # peer's synced booking, it holds "second" until "first" finishes.
    sessions = [_one_shot("first", 0.0), _one_shot("second", 0.01)]
    alone = _simulate_replicas(tmp_path, sessions, pool_wide=False)
    shared = _simulate_replicas(tmp_path, sessions, pool_wide=True)
    for simulator in (alone, shared):
        assert isinstance(simulator.router, FlowControlledReplicas)
        gate = simulator.router.flow_gate
        assert all(r.completed for r in simulator.records)
        assert len(gate) == 0 and gate.member == {}
        assert [g.controller.booked() for g in gate.gates] == [0, 0]
    assert alone.router.flow_gate.queue_time_s == {"first#0": 0.0, "second#0": 0.0}
    waited = shared.router.flow_gate.queue_time_s
    first = next(r for r in shared.records if r.session_id == "first")
    assert waited["first#0"] == 0.0 and waited["second#0"] >= first.finish - 0.01 - 0.002  # type: ignore[operator]


def test_pool_wide_token_load_needs_synced_replicas(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs synced replicas"):
        flow_controlled_replicas(CONFIG, lambda: 0.0, 0, replicas=2, sync_delay_s=None, pool_wide=True)


ISOLATION_CONFIG = """
plugins:
- type: queue-scorer
- type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: 400000, maxPrefillTokensPerEndpoint: 8192, isolatedPrefillTokens: 2048}
flowControl:
  saturationDetectors: [token-load-saturation-detector]
  defaultBand: {ttlSeconds: 30}
"""


def test_prefill_isolation_holds_the_pick_to_the_endpoints_a_request_fits(tmp_path: Path) -> None:
    # Two replicas. A 3000-token prompt goes first; the second may join it but not take the idle
    # replica, which the queue scorer alone would pick; the chat with a TTFT objective goes there.
    sessions = [
        Session("long-1", 0.0, (Turn(3000, 50),), tenant="A"),
        Session("long-2", 0.01, (Turn(3000, 50),), tenant="A"),
        Session("chat", 0.02, (Turn(300, 20),), tenant="B", slo_ttft_ms=500),
    ]
    simulator = _simulate(tmp_path, sessions, ISOLATION_CONFIG, replicas=2)
    replica = {r.session_id: r.replica for r in simulator.records}
    assert all(r.completed for r in simulator.records)
    assert replica["long-2"] == replica["long-1"]
    assert replica["chat"] != replica["long-1"]
