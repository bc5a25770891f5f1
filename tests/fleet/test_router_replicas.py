"""K EPP replicas in the fleet simulator: K=1 is today's router, runs are deterministic, and with
sync every replica's view of the token load becomes the sum of all replicas' bookings d later."""

from __future__ import annotations

import pytest

from bench.workloads.fleet_workloads import WorkloadOptions, build_workload
from epp.configs import CONFIG_DIR
from epp.load.token_load import EndpointLoad
from epp.plugins.token_load import find_token_load
from epp.scheduling.types import ApiKind, LLMRequest
from sim.engine import load_profile
from sim.fleet import FleetConfig, FleetSimulator, Workload, make_router
from sim.fleet.replica import Replica
from sim.fleet.router_replicas import ReplicatedRouter
from sim.fleet.routers import RoutingCall
from tests.fleet.sessions import fingerprint, random_sessions

PROFILE = "llama-3.1-8b-h100"


def _run(router: str, workload: Workload, **replication: object):
    config = FleetConfig(replicas=3, profile=PROFILE, retrain_interval_s=2.0)
    return FleetSimulator(
        workload,
        lambda clock: make_router(router, clock, 7, **replication),
        config,  # type: ignore[arg-type]
    ).run()


@pytest.mark.parametrize("router", ["gie-default", "ray-kv-aware", "predicted-latency-token-load"])
@pytest.mark.parametrize("sync_delay_s", [0.05, None])
def test_one_replica_routes_exactly_as_the_single_router(router: str, sync_delay_s: float | None) -> None:
    workload = Workload("t", random_sessions(30, 3, seed=4, spread_s=15.0), slo_ttft_ms=500, slo_tpot_ms=50)
    single = _run(router, workload)
    replicated = _run(router, workload, router_replicas=1, sync_delay_s=sync_delay_s)
    assert fingerprint(replicated) == fingerprint(single)
    assert replicated.retrains == single.retrains


def test_four_synced_replicas_are_deterministic_and_sync_changes_their_routing() -> None:
    workload = Workload("t", random_sessions(40, 3, seed=5, spread_s=10.0))
    synced = fingerprint(_run("ray-kv-aware", workload, router_replicas=4, sync_delay_s=0.05))
    assert synced == fingerprint(_run("ray-kv-aware", workload, router_replicas=4, sync_delay_s=0.05))
    unsynced = fingerprint(_run("ray-kv-aware", workload, router_replicas=4, sync_delay_s=None))
    assert [row[1] for row in synced] != [row[1] for row in unsynced]  # different endpoints picked


def _call(index: int, prompt: int) -> RoutingCall:
    request = LLMRequest(
        request_id=f"r{index}",
        model="fleet",
        api=ApiKind.CHAT,
        prompt_token_ids=[1000 * index + t for t in range(prompt)],
        stream=True,
        max_tokens=200,
    )
    return RoutingCall(request, 200, [])


class _Drive:
    """Routes requests through a ReplicatedRouter by hand, on a virtual clock."""

    def __init__(self, sync_delay_s: float | None) -> None:
        self.now = 0.0
        profile = load_profile(PROFILE)
        self.endpoints = [Replica(index, profile) for index in range(3)]
        self.router = ReplicatedRouter(
            "ray-kv-aware", lambda: self.now, 3, replicas=3, sync_delay_s=sync_delay_s
        )
        self.producers = [find_token_load(m.pipeline.plugins.values()) for m in self.router.members]
        self.routed: dict[str, tuple[RoutingCall, Replica]] = {}

    def views(self) -> list[dict[str, EndpointLoad]]:
        """What each replica's scorers read: its own bookings plus the peers' it has applied."""
        return [{e.name: p.load(e.name) for e in self.endpoints} for p in self.producers]  # type: ignore[union-attr]

    def reference(self) -> dict[str, EndpointLoad]:
        """The truth: the sum of every replica's own bookings."""
        total = {e.name: EndpointLoad() for e in self.endpoints}
        for producer in self.producers:
            for name in total:
                total[name] += producer.tracker.load(name)  # type: ignore[union-attr]
        return total

    def at(self, now: float) -> None:
        self.now = now
        self.router.catch_up(now)

    def route(self, index: int, prompt: int) -> None:
        call = _call(index, prompt)
        self.routed[call.request.request_id] = (call, self.router.route(call, self.endpoints, self.now))

    def first_token(self, request_id: str) -> None:
        self.router.on_first_token(self.routed[request_id][0], self.now)

    def progress(self, request_id: str, tokens: int) -> None:
        self.router.on_progress(self.routed[request_id][0], tokens, self.now)

    def finish(self, request_id: str) -> None:
        call, _ = self.routed.pop(request_id)
        self.router.on_finished(call, self.now, completed=True, completion_tokens=5)


def _traffic(drive: _Drive) -> None:
    for index in range(12):
        drive.at(0.01 * index)
        drive.route(index, 300 + 97 * index)
    drive.at(1.0)
    for index in range(8):
        drive.first_token(f"r{index}")
        drive.progress(f"r{index}", 3 + index)
    for index in range(3):
        drive.finish(f"r{index}")


def test_synced_views_converge_to_the_sum_of_all_bookings_after_the_delay() -> None:
    drive = _Drive(sync_delay_s=0.5)
    _traffic(drive)
    reference = drive.reference()
    assert sum(load.requests for load in reference.values()) == 9
    drive.at(1.06)  # the decode progress is flushed at the first decision after its 50 ms tick
    drive.at(1.0 + 0.5 - 1e-6)  # the finishes and first tokens of 1.0 are still on the wire
    assert all(view != reference for view in drive.views())
    drive.at(1.0 + 0.5)  # the finishes and first tokens arrive; the progress is still on the wire
    assert all(view != reference for view in drive.views())
    drive.at(1.06 + 0.5)
    assert drive.views() == [reference] * 3
    drive.at(3.0)  # nothing more was sent: still converged
    assert drive.views() == [reference] * 3
    assert all(len(state.peers) == 2 and state.stats.gaps == 0 for state in drive.router.sync)


def test_unsynced_views_see_only_their_own_bookings() -> None:
    drive = _Drive(sync_delay_s=None)
    _traffic(drive)
    drive.at(10.0)
    reference = drive.reference()
    views = drive.views()
    assert all(view != reference for view in views)
    for view, producer in zip(views, drive.producers, strict=True):
        assert view == {e.name: producer.tracker.load(e.name) for e in drive.endpoints}  # type: ignore[union-attr]


def _burst_endpoints(router: str, replicas: int, sync_delay_s: float | None, seed: int) -> set[str]:
    """Where one router, or ``replicas`` EPP replicas, send 8 identical prompts that arrive at
    once (one RL step's rollouts) on 4 idle engines."""
    profile = load_profile(PROFILE)
    endpoints = [Replica(index, profile) for index in range(4)]
    clock = lambda: 0.0  # noqa: E731
    chosen = make_router(router, clock, seed, router_replicas=replicas, sync_delay_s=sync_delay_s)
    calls = [
        RoutingCall(
            LLMRequest(
                request_id=f"r{i}", model="fleet", api=ApiKind.CHAT, prompt_token_ids=list(range(2048))
            ),
            200,
            [],
        )
        for i in range(8)
    ]
    return {chosen.route(call, endpoints, 0.0).name for call in calls}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_synced_replicas_keep_a_burst_of_identical_prompts_together_as_one_router_does(seed: int) -> None:
    assert len(_burst_endpoints("gie-default", 1, None, seed)) == 1
    assert len(_burst_endpoints("gie-default", 4, 0.05, seed)) == 1
    # Unsynced replicas break the tie with their own RNGs, so the rollouts (and their prefix
    # caches) are split over several engines.
    assert len(_burst_endpoints("gie-default", 4, None, seed)) > 1


def _later_turn_moves(router: str, **replication: object) -> int:
    """RL rollouts' turns after the second that went to another engine than the turn before."""
    workload = build_workload("rl-stragglers", WorkloadOptions(scale=1.0, seed=0, limit=1))
    by_turn = {(r.session_id, r.turn): r for r in _run(router, workload, **replication).records}
    return sum(1 for (s, t), r in by_turn.items() if t >= 2 and r.replica != by_turn[(s, t - 1)].replica)


def test_synced_ray_kv_aware_replicas_keep_rl_rollouts_on_their_engines_as_one_router_does(tmp_path) -> None:
    # 16 rollouts x 10 turns whose turns end together: replicas 50 ms apart each read an engine
    # as emptier than it is by their peers' latest picks, and (without replicaMoveMargin) move
    # rollouts onto the same one, off the engine that holds their prefix.
    single = _later_turn_moves("ray-kv-aware")
    assert single < 10
    assert _later_turn_moves("ray-kv-aware", router_replicas=4, sync_delay_s=0.05) <= single
    config = (
        (CONFIG_DIR / "ray-kv-aware.yaml")
        .read_text()
        .replace("replicaMoveMargin: 1.0", "replicaMoveMargin: 0")
    )
    no_margin = tmp_path / "ray-kv-aware-no-margin.yaml"
    no_margin.write_text(config)
    assert _later_turn_moves(str(no_margin), router_replicas=4, sync_delay_s=0.05) > 4 * single
