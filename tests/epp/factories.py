"""Small builders and fakes for EPP tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from epp.latency.client import PredictorClient, PredictorClientSettings
from epp.latency.metrics import PredictionMetrics
from epp.load.peer_totals import pack_tail_rows
from epp.metrics import ModelLabels
from epp.scheduling.framework import CycleState
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.predictor import Prediction, PredictionUnavailable
from epp.scheduling.types import ApiKind, Endpoint, EndpointState, EngineMetrics, LLMRequest, SchedulingResult
from epp.settings import EppSettings
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from sim.processes import free_port, write_endpoints_file
from wire.latency import FeatureRowDict, TrainingSampleDict


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def local_epp_settings(tmp_path: Path, **overrides: Any) -> EppSettings:
    """Settings for an in-process EPP on loopback, on ports the OS picks, with the tiny tokenizer and
    one file-listed endpoint on a free port (nothing listens there); ``overrides`` set the rest."""
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("127.0.0.1", free_port())])
    return EppSettings(
        host="127.0.0.1",
        grpc_port=0,
        health_port=0,
        metrics_port=0,
        endpoints_file=endpoints,
        tokenizer_dir=TINY_MODEL_DIR,
        **overrides,
    )


def endpoint_state(i: int, *, waiting: int = 0, kv: float = 0.0, running: int = 0) -> EndpointState:
    return EndpointState(
        Endpoint(f"e{i}", "127.0.0.1", 8100 + i),
        EngineMetrics(waiting=waiting, running=running, kv_cache_usage=kv, updated_at=0.0),
    )


def make_request(tokens: list[int], model: str = "tiny", request_id: str = "r") -> LLMRequest:
    return LLMRequest(request_id=request_id, model=model, api=ApiKind.COMPLETIONS, prompt_token_ids=tokens)


TEN_MIB = 10 << 20


class CountingTokenizer(ModelTokenizer):
    """The tiny model's tokenizer, noting the length of every text it tokenizes."""

    def __init__(self) -> None:
        super().__init__(TINY_MODEL_DIR)
        self.encoded: list[int] = []

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, max_chars)


class FakePredictor:
    """TTFT grows with the queue, TPOT with the running batch; records training samples."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[list[FeatureRowDict]] = []
        self.samples: list[TrainingSampleDict] = []

    async def predict(self, rows: Sequence[FeatureRowDict]) -> list[Prediction]:
        self.calls.append(list(rows))
        if self.fail:
            raise PredictionUnavailable(self.fail)
        return [
            Prediction(100.0 + 100.0 * r["num_request_waiting"], 10.0 + 5.0 * r["num_request_running"])
            for r in rows
        ]

    def add_training(self, samples: Sequence[TrainingSampleDict]) -> None:
        self.samples.extend(samples)


def run(coro: Any) -> Any:
    """Drive a coroutine that never suspends (as the fleet simulator does)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("coroutine suspended")


async def client_for(
    urls: list[str], trainer: str | None = None, clock: Callable[[], float] = time.monotonic, **kw: Any
) -> PredictorClient:
    metrics = PredictionMetrics(CollectorRegistry(), ModelLabels())
    client = PredictorClient(PredictorClientSettings(urls, trainer, **kw), clock, metrics)
    await client.start()
    return client


def tail_rows(*bookings: tuple[int, int]) -> bytes:
    """Packed tail rows of not yet prefilled bookings, each (tail, prompt_tokens), 30 tokens expected."""
    return pack_tail_rows([(tail, prompt, prompt, 0, 30, prompt) for tail, prompt in bookings])


def routed_request(
    request: LLMRequest, result: SchedulingResult, state: CycleState, received_at: float = 0.0
) -> RoutedRequest:
    """``request`` as the lifecycle routes it to ``result``'s endpoint (an observer's input)."""
    return RoutedRequest(request, result, state, EndpointState(result.endpoint, EngineMetrics()), received_at)
