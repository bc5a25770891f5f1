"""Scrape sharing in the fleet simulator: a replica routes on live scrapes of the engines it owns
and on the owners' shared ones, a batching phase plus the sync delay late, of the others."""

from __future__ import annotations

import pytest

from epp.sync.scrape_owners import owner
from sim.engine import load_profile
from sim.fleet import FleetConfig, FleetSimulator, Workload, make_router
from sim.fleet.replica import Replica
from sim.fleet.router_replicas import ReplicatedRouter
from tests.fleet.sessions import fingerprint, random_sessions
from tests.fleet.test_router_replicas import PROFILE, _call


def test_a_non_owner_reads_the_latest_scrape_its_lag_lets_through() -> None:
    replica = Replica(0, load_profile(PROFILE))
    replica.shared_lag_s = 0.07
    for tick in (0.0, 0.05, 0.10, 0.15):
        replica.scrape(tick)
    assert replica.shared_metrics(0.16).updated_at == 0.05  # 0.10's arrives at 0.17
    assert replica.shared_metrics(0.17).updated_at == pytest.approx(0.10)
    assert replica.shared_metrics(0.01).updated_at == 0.0  # none arrived yet: the oldest kept
    assert replica.state.metrics.updated_at == 0.15  # the owner's own, live


def test_each_member_routes_on_live_scrapes_of_its_own_engines_and_late_ones_of_the_others() -> None:
    now = [1.1]
    router = ReplicatedRouter(
        "gie-default", lambda: now[0], 3, replicas=3, sync_delay_s=0.01, share_scrapes=True
    )
    engines = [Replica(index, load_profile(PROFILE)) for index in range(4)]
    for engine in engines:
        engine.shared_lag_s = router.scrape_lag_s(engine.name)
        assert engine.shared_lag_s is not None and 0.01 <= engine.shared_lag_s < 0.06
        engine.scrape(0.90)
        engine.scrape(0.95)
    seen: list[dict[str, float]] = []
    for member in router.members:
        original = member.route

        def spy(call, replicas, at, original=original):  # type: ignore[no-untyped-def]
            seen.append({r.name: r.state.metrics.updated_at for r in replicas})
            return original(call, replicas, at)

        member.route = spy  # type: ignore[method-assign]
    for index in range(3):
        router.route_on(index, _call(index, 50), engines, now[0])
    names = [state.replica_id for state in router.sync]
    for index, view in enumerate(seen):
        for engine in engines:
            mine = owner(engine.name, names) == names[index]
            # Every scrape has arrived by now (1.1 s): the owner and the others read the last one.
            assert view[engine.name] == 0.95, (index, engine.name, mine)
    # Read 10 ms after the last tick, only the engines' owners have seen it.
    now[0] = 0.96
    seen.clear()
    router.route_on(0, _call(9, 50), engines, now[0])
    for engine in engines:
        mine = owner(engine.name, names) == names[0]
        assert seen[0][engine.name] == (0.95 if mine else 0.90)
        assert engine.state.metrics.updated_at == 0.95  # the live figures are back after the decision


def test_replicas_that_share_scrapes_run_deterministically_to_the_end() -> None:
    workload = Workload("t", random_sessions(30, 3, seed=6, spread_s=10.0))
    config = FleetConfig(replicas=3, profile=PROFILE, retrain_interval_s=2.0)

    def run() -> list[tuple[object, ...]]:
        factory = lambda clock: make_router(  # noqa: E731
            "ray-kv-aware", clock, 7, router_replicas=3, sync_delay_s=0.05, share_scrapes=True
        )
        result = FleetSimulator(workload, factory, config).run()
        assert all(r.completed for r in result.records)
        return fingerprint(result)

    assert run() == run()
    with pytest.raises(ValueError, match="sync delay"):
        make_router("ray-kv-aware", lambda: 0.0, 7, router_replicas=3, share_scrapes=True)
