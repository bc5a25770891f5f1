"""Replica sync hooked into real scheduling pipelines: what one replica routes, the other scores."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from epp.configs import config_path
from epp.load.peer_totals import PeerTotals
from epp.load.token_load import EndpointLoad, TokenLoadTracker
from epp.plugins.predicted_latency import PredictedLatencyProducer, find_predicted_latency
from epp.plugins.prefix_cache import find_prefix_index
from epp.plugins.token_load import find_token_load
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext, RunsAmongReplicas
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.pipeline import Pipeline
from epp.scheduling.predictor import Prediction
from epp.sync.hook import attach_replica_sync, sync_targets
from epp.sync.state import ReplicaSyncState
from tests.epp.factories import FakeClock, endpoint_state, make_request, run


class ConstantPredictor:
    async def predict(self, rows: list[dict[str, Any]]) -> list[Prediction]:
        return [Prediction(100.0, 10.0) for _ in rows]

    def add_training(self, samples: Any) -> None:
        pass


class SyncedReplica:
    def __init__(self, name: str, config: str, clock: FakeClock) -> None:
        context = PluginContext(clock=clock, latency_predictor=ConstantPredictor())  # type: ignore[arg-type]
        self.pipeline: Pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path(config)), context)
        self.sync = ReplicaSyncState(name, sync_targets(self.pipeline), clock=clock)
        self.lifecycle = RequestLifecycle(self.pipeline)
        attach_replica_sync(self.lifecycle, self.sync)
        self.token_load = find_token_load(self.pipeline.plugins.values())

    def route(self, tokens: list[int], **fields: Any) -> RoutedRequest:
        request = make_request(tokens)
        for name, value in fields.items():
            setattr(request, name, value)
        return run(self.lifecycle.route(request, [endpoint_state(0), endpoint_state(1)], 0.0, 0.0))

    def stream(self, routed: RoutedRequest, tokens: int) -> None:
        if tokens == 1:
            self.lifecycle.first_token(routed, 0.5)
        self.lifecycle.progress(routed, tokens, 0.5)

    def finish(self, routed: RoutedRequest) -> None:
        self.lifecycle.finished(routed, 1.0, status=200, completed=True, streaming=True, completion_tokens=3)

    def send_to(self, other: SyncedReplica) -> None:
        self.sync.flush()
        for data in self.sync.take_messages():
            other.sync.receive(data)


def test_a_peers_booking_shows_in_the_token_load_that_scoring_reads() -> None:
    clock = FakeClock()
    a, b = SyncedReplica("a", "ray-kv-aware", clock), SyncedReplica("b", "ray-kv-aware", clock)
    prompt = list(range(200))
    routed = a.route(prompt, max_tokens=30)
    target = routed.endpoint_name
    a.send_to(b)
    assert a.token_load is not None and b.token_load is not None
    own = a.token_load.tracker.load(target)
    assert own.requests == 1 and b.token_load.load(target) == own
    assert b.token_load.tracker.in_flight() == 0  # nothing of b's own
    # b's next request sees a's booking in its token load and a's blocks in its prefix match.
    state = b.route(prompt, max_tokens=30).state
    assert state.get(TOKEN_LOAD)[target] == own
    match = state.get(PREFIX_MATCH)
    assert match is not None and match.matched_blocks.get(target) == len(prompt) // 16
    b.sync.take_messages()  # b's own booking stays out of this test
    a.stream(routed, 1)
    a.stream(routed, 5)
    a.send_to(b)
    assert b.token_load.peers.load(target) == a.token_load.tracker.load(target)
    assert b.token_load.peers.load(target).decode_tokens == 205
    a.finish(routed)
    a.send_to(b)
    assert b.token_load.peers.load(target) == EndpointLoad() and b.token_load.peers.in_flight() == 0


def test_a_peers_running_tpot_slo_binds_on_its_endpoint() -> None:
    clock = FakeClock()
    config = "predicted-latency-token-load"
    a, b = SyncedReplica("a", config, clock), SyncedReplica("b", config, clock)
    routed = a.route(list(range(64)), stream=True, slo_tpot_ms=25.0, max_tokens=8)
    target = routed.endpoint_name
    a.send_to(b)
    b_latency = next(p for p in b.pipeline.plugins.values() if isinstance(p, PredictedLatencyProducer))
    assert list(b_latency.running_tpot_slos[target].values()) == [25.0]
    a.finish(routed)
    a.send_to(b)
    assert b_latency.running_tpot_slos[target] == {}


def test_a_late_replicas_snapshot_brings_the_peers_prefix_index() -> None:
    clock = FakeClock()
    a, late = SyncedReplica("a", "gie-default", clock), SyncedReplica("late", "gie-default", clock)
    prompt = list(range(64 * 5))
    routed = a.route(prompt)
    a.sync.take_messages()  # published before late existed
    a.route(list(range(1000, 1064)))
    a.send_to(late)  # late sees a mid-stream and asks for a snapshot
    assert late.sync.wanted_snapshots() == ["a"]
    late.sync.receive(a.sync.answer(late.sync.snapshot_request()))
    state = late.route(prompt).state
    assert state.get(PREFIX_MATCH).matched_blocks.get(routed.endpoint_name) == 5


def test_a_conversations_next_turn_releases_its_last_turn_booked_by_a_peer() -> None:
    # a routed turn 1 and has finished it, but its release is still on the way to b when turn 2
    # (turn 1's prompt, its output, a new message) reaches b.
    clock = FakeClock()
    a, b = SyncedReplica("a", "ray-kv-aware", clock), SyncedReplica("b", "ray-kv-aware", clock)
    turn1 = list(range(320))
    routed = a.route(turn1, max_tokens=30)
    target = routed.endpoint_name
    a.send_to(b)
    assert b.token_load is not None and b.token_load.peers.load(target).requests == 1
    a.finish(routed)
    release = a.sync.take_messages()
    state = b.route([*turn1, *range(5000, 5100)], max_tokens=30).state
    assert b.token_load.peers.in_flight() == 0
    assert state.get(TOKEN_LOAD)[target] == EndpointLoad()  # scored without the finished turn
    for data in release:  # the release arrives: nothing left to release, nothing refused
        b.sync.receive(data)
    assert b.token_load.peers.in_flight() == 0 and not b.sync.stats.dropped


def test_concurrent_requests_on_a_peers_prompt_keep_its_booking() -> None:
    clock = FakeClock()
    a, b = SyncedReplica("a", "ray-kv-aware", clock), SyncedReplica("b", "ray-kv-aware", clock)
    prompt = list(range(320))
    a.route(prompt, max_tokens=30)
    a.send_to(b)
    assert b.token_load is not None
    b.route(prompt, max_tokens=30)  # the same prompt again: it extends nothing
    assert b.token_load.peers.in_flight() == 1


def test_ray_kv_aware_replicas_keep_a_conversation_where_a_lone_router_would_move_it() -> None:
    clock = FakeClock()
    a, b = SyncedReplica("a", "ray-kv-aware", clock), SyncedReplica("b", "ray-kv-aware", clock)
    alone = SyncedReplica("alone", "ray-kv-aware", clock)
    turn1 = list(range(320))
    turn2 = [*turn1, *range(5000, 5100)]  # 26.25 blocks, 20 of them cached where turn 1 went
    homes = {}
    for replica in (alone, b):
        routed = replica.route(turn1, max_tokens=30)
        replica.finish(routed)
        homes[replica] = routed.endpoint_name
        assert replica.token_load is not None  # 30 blocks of others' KV where turn 1 went
        replica.token_load.tracker.admit("other", routed.endpoint_name, 480, 480, 10)
    # Alone: 100/16 + 480/16 = 36.25 where the prefix is, 26.25 on the empty endpoint: it moves.
    assert alone.route(turn2, max_tokens=30).endpoint_name != homes[alone]
    # b hears a live peer, so the empty endpoint costs one more pick of turn 2's size (52.5).
    b.sync.receive(a.sync.heartbeat())
    assert b.sync.peer_count == 1
    assert b.route(turn2, max_tokens=30).endpoint_name == homes[b]


def test_every_plugin_that_runs_among_replicas_is_told_of_live_peers() -> None:
    clock = FakeClock()
    a = SyncedReplica("a", "predicted-latency-token-load", clock)
    b = SyncedReplica("b", "predicted-latency-token-load", clock)
    joined = {p.type_name for p in b.pipeline.plugins.values() if isinstance(p, RunsAmongReplicas)}
    assert joined == {"max-score-picker", "prefix-cache-affinity-filter", "token-load-scorer"}
    sticky = b.pipeline.plugins["loose-affinity-filter"]
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 9}, block_size_tokens=10))
    # Staying: 60 booked + 10 + 60 KV = 130 tokens; moving: 100.
    state.put(TOKEN_LOAD, {"e0": EndpointLoad(requests=1, prefill_tokens=60, kv_tokens=60)})
    assert sticky.filter(request, endpoints, state) == endpoints  # b alone: the gate opens
    a.route(list(range(500, 600)))
    a.send_to(b)  # b hears a: its token load now lags a's picks, so the gate stays shut
    assert b.sync.peer_count == 1
    assert sticky.filter(request, endpoints, state) == [endpoints[0]]


def test_sync_finds_what_it_shares_by_capability_not_by_class() -> None:
    """A plugin of any class that books token load, indexes prefixes or predicts latency is where
    peers' deltas go; the shipped producers are found the same way."""

    class OwnTokenLoad:
        def __init__(self) -> None:
            self.tracker = TokenLoadTracker()
            self.peers = PeerTotals()

    own = OwnTokenLoad()
    assert find_token_load([object(), own]) is own
    assert sync_targets(SimpleNamespace(plugins={"own": own})).token_load is own.peers  # type: ignore[arg-type]
    shipped = SyncedReplica("a", "predicted-latency-token-load", FakeClock())
    targets = sync_targets(shipped.pipeline)
    assert targets.token_load is not None and targets.tpot_slos is not None
    assert targets.record_prefix is not None and targets.prefix_block_size > 0
    assert find_prefix_index([object()]) is None and find_predicted_latency([object()]) is None
