"""Replica sync hooked into real scheduling pipelines: what one replica routes, the other scores."""

from __future__ import annotations

from typing import Any

from epp.configs import config_path
from epp.latency.predictions import Prediction
from epp.load.token_load import EndpointLoad
from epp.plugins.predicted_latency import PredictedLatencyProducer
from epp.plugins.token_load import find_token_load
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from epp.scheduling.pipeline import Pipeline
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
        attach_replica_sync(self.pipeline, self.sync, context)
        self.token_load = find_token_load(self.pipeline.plugins.values())

    def route(self, tokens: list[int], **fields: Any):
        request = make_request(tokens)
        for name, value in fields.items():
            setattr(request, name, value)
        state = CycleState()
        result = run(self.pipeline.schedule(request, [endpoint_state(0), endpoint_state(1)], state))
        return request, result, state

    def stream(self, routed, tokens: int) -> None:
        request, result, state = routed
        for observer in self.pipeline.observers:
            if tokens == 1:
                observer.on_first_token(request, result, state, 0.0)
            observer.on_progress(request, result, state, tokens, 0.0)

    def finish(self, routed) -> None:
        request, result, state = routed
        outcome = RequestOutcome(result.endpoint, 0.0, 1.0, 200, True, True, 0.5, 3)
        for observer in self.pipeline.observers:
            observer.on_finished(request, result, state, outcome)

    def send_to(self, other: SyncedReplica) -> None:
        self.sync.flush_progress()
        for data in self.sync.take_messages():
            other.sync.receive(data)


def test_a_peers_booking_shows_in_the_token_load_that_scoring_reads() -> None:
    clock = FakeClock()
    a, b = SyncedReplica("a", "ray-kv-aware", clock), SyncedReplica("b", "ray-kv-aware", clock)
    prompt = list(range(200))
    routed = a.route(prompt, max_tokens=30)
    target = routed[1].endpoint.name
    a.send_to(b)
    assert a.token_load is not None and b.token_load is not None
    own = a.token_load.tracker.load(target)
    assert own.requests == 1 and b.token_load.load(target) == own
    assert b.token_load.tracker.in_flight() == 0  # nothing of b's own
    # b's next request sees a's booking in its token load and a's blocks in its prefix match.
    _, _, state = b.route(prompt, max_tokens=30)
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
    target = routed[1].endpoint.name
    a.send_to(b)
    b_latency = next(p for p in b.pipeline.plugins.values() if isinstance(p, PredictedLatencyProducer))
    assert list(b_latency.running_tpot_slos[target].values()) == [25.0]
    a.finish(routed)
    a.send_to(b)
    assert b_latency.running_tpot_slos[target] == {}
