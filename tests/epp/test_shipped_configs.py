"""Every shipped EndpointPickerConfig loads through the real loader and routes requests."""

from __future__ import annotations

import random

import pytest

from epp.configs import CONFIG_DIR, config_path
from epp.plugins.token_load import find_token_load
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from tests.epp.factories import FakeClock, FakePredictor, endpoint_state, make_request, routed_request

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
ROUTER_CONFIGS = {
    "gie-default", "predicted-latency", "ray-consistent-hash", "ray-prefix-affinity", "ray-kv-aware",
    "dynamo-kv-t0", "dynamo-kv-t1", "kv-affinity", "round-robin", "random", "power-of-two",
    "least-request", "predicted-latency-token-load",
}  # fmt: skip


def test_every_router_has_a_shipped_config() -> None:
    assert set(SHIPPED) >= ROUTER_CONFIGS


@pytest.mark.parametrize("name", SHIPPED)
async def test_shipped_config_schedules_requests_on_fake_endpoints(name: str) -> None:
    text = config_path(name).read_text()
    assert text.startswith("#"), "a shipped config starts with a comment saying what it reproduces"
    context = PluginContext(clock=FakeClock(), rng=random.Random(5), latency_predictor=FakePredictor())
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(text), context)
    assert pipeline.profile.name in (name, "default")
    endpoints = [endpoint_state(i, waiting=i, running=i, kv=0.1 * i) for i in range(4)]
    outcomes = []
    for i in range(8):
        request = make_request(list(range(200 + i)), request_id=f"r{i}")
        request.max_tokens = 8
        request.headers = {"x-session-id": f"s{i % 3}"}
        state = CycleState()
        result = await pipeline.schedule(request, endpoints, state)
        assert result.endpoint.name in {e.name for e in endpoints}
        # Fallbacks for the gateway's retries: distinct endpoints after the pick (at most 3 in all).
        names = [t.name for t in result.targets]
        assert 1 <= len(names) <= 3 and len(set(names)) == len(names)
        outcomes.append((request, result, state))
    for request, result, state in outcomes:
        for observer in pipeline.observers:
            observer.on_first_token(routed_request(request, result, state), 1.0)
            observer.on_progress(routed_request(request, result, state), 3, 1.5)
        outcome = RequestOutcome(result.endpoint, 0.0, 2.0, 200, True, True, 1.0, 3)
        for observer in pipeline.observers:
            observer.on_finished(routed_request(request, result, state), outcome)
    token_load = find_token_load(pipeline.plugins.values())
    if token_load is not None:
        assert token_load.tracker.in_flight() == 0
