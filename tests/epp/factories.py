"""Small builders for scheduling-core tests."""

from __future__ import annotations

from epp.scheduling.types import ApiKind, Endpoint, EndpointState, EngineMetrics, LLMRequest


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def endpoint_state(i: int, *, waiting: int = 0, kv: float = 0.0, running: int = 0) -> EndpointState:
    return EndpointState(
        Endpoint(f"e{i}", "127.0.0.1", 8100 + i),
        EngineMetrics(waiting=waiting, running=running, kv_cache_usage=kv, updated_at=0.0),
    )


def make_request(tokens: list[int], model: str = "tiny", request_id: str = "r") -> LLMRequest:
    return LLMRequest(request_id=request_id, model=model, api=ApiKind.COMPLETIONS, prompt_token_ids=tokens)
