"""The predictor client against real HTTP servers on loopback (aiohttp), one per 'instance', that
speak the predictor's binary form (``wire.latency_binary``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from epp.scheduling.predictor import Prediction, PredictionUnavailable
from tests.epp.factories import FakeClock, client_for
from tests.trainer.synthetic import feature_rows
from wire.latency import POD_TYPES
from wire.latency_binary import (
    CONSTANT_MODELS_HEADER,
    FEATURE_ROW_FIELDS,
    FEATURE_ROWS_TYPE,
    MODEL_VERSION_HEADER,
    PREDICTIONS_TYPE,
    decode_rows,
    encode_predictions,
)


@dataclass
class FakeServer:
    """Answers like a predictor (ttft = input length) or like a trainer, as configured."""

    status: int = 200
    delay_s: float = 0.0
    calls: list[np.ndarray] = field(default_factory=list)
    """The feature matrix of each prediction call."""
    training: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    model_version: int | None = None
    constant_models: str | None = None
    content_type: str = PREDICTIONS_TYPE
    retrain_headers: list[str | None] = field(default_factory=list)
    connections: set[int] = field(default_factory=set)
    """The connections prediction calls came on (their transports' ids)."""

    async def predict(self, request: web.Request) -> web.Response:
        assert request.content_type == FEATURE_ROWS_TYPE
        self.connections.add(id(request.transport))
        matrix = decode_rows(await request.read())
        self.calls.append(matrix)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"detail": "no"}, status=self.status)
        lengths = matrix[:, FEATURE_ROW_FIELDS.index("input_token_length")]
        headers = {} if self.model_version is None else {MODEL_VERSION_HEADER: str(self.model_version)}
        if self.constant_models is not None:
            headers[CONSTANT_MODELS_HEADER] = self.constant_models
        body = encode_predictions(lengths, np.ones(len(lengths)))
        return web.Response(body=body, content_type=self.content_type, headers=headers)

    async def retrain(self, request: web.Request) -> web.Response:
        self.retrain_headers.append(request.headers.get("authorization"))
        return web.json_response({"retrain": "requested"}, status=202)

    async def train(self, request: web.Request) -> web.Response:
        self.training.extend((await request.json())["entries"])
        return web.json_response({"accepted": len(self.training)}, status=202)


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeServer]]:
    fakes, runners = [FakeServer(), FakeServer()], []
    for fake in fakes:
        app = web.Application()
        app.router.add_post("/predict/bulk/strict", fake.predict)
        app.router.add_post("/add_training_data_bulk", fake.train)
        app.router.add_post("/retrain", fake.retrain)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        runners.append(runner)
    yield fakes
    for runner in runners:
        await runner.cleanup()


def rows(*lengths: int) -> list[dict[str, Any]]:
    """Feature rows whose prompts are ``lengths`` tokens long (the fake predicts TTFT = length)."""
    return [
        {**row, "input_token_length": n} for row, n in zip(feature_rows(len(lengths)), lengths, strict=True)
    ]


async def test_concurrent_callers_are_coalesced_into_one_call(servers: list[FakeServer]) -> None:
    client = await client_for([servers[0].url])
    try:
        results = await asyncio.gather(*(client.predict(rows(i, i + 1)) for i in range(10)))
        assert results[3] == [Prediction(3.0, 1.0), Prediction(4.0, 1.0)]
        assert len(servers[0].calls) == 1 and len(servers[0].calls[0]) == 20
    finally:
        await client.close()


async def test_a_lone_caller_does_not_wait_for_the_coalescing_window(servers: list[FakeServer]) -> None:
    # With no call in flight the window is skipped; were it not, this call would time out.
    client = await client_for([servers[0].url], coalesce_window_s=30.0, timeout_s=5.0)
    try:
        assert await client.predict(rows(7)) == [Prediction(7.0, 1.0)]
    finally:
        await client.close()


async def test_callers_arriving_during_a_call_share_the_next_one(servers: list[FakeServer]) -> None:
    servers[0].delay_s = 0.2
    client = await client_for([servers[0].url], coalesce_window_s=0.1)
    try:
        first = asyncio.create_task(client.predict(rows(1)))
        while not servers[0].calls:  # the first call is at the server
            await asyncio.sleep(0.005)
        later = [asyncio.create_task(client.predict(rows(n))) for n in (2, 3)]
        await asyncio.sleep(0.02)  # the window is still open: the second call waits for more
        later.append(asyncio.create_task(client.predict(rows(4))))
        results = await asyncio.gather(first, *later)
        assert [r[0].ttft_ms for r in results] == [1.0, 2.0, 3.0, 4.0]
        assert [len(call) for call in servers[0].calls] == [1, 3]
    finally:
        await client.close()


async def test_calls_are_spread_over_instances(servers: list[FakeServer]) -> None:
    client = await client_for([s.url for s in servers])
    try:
        for i in range(6):
            await client.predict(rows(i))
        assert len(servers[0].calls) == 3 and len(servers[1].calls) == 3
    finally:
        await client.close()


async def test_slow_predictor_is_time_boxed(servers: list[FakeServer]) -> None:
    servers[0].delay_s = 2.0
    client = await client_for([servers[0].url], timeout_s=0.1)
    try:
        started = time.monotonic()
        with pytest.raises(PredictionUnavailable) as info:
            await client.predict(rows(1))
        assert info.value.reason == "timeout" and time.monotonic() - started < 1.0
    finally:
        await client.close()


async def test_failing_instance_trips_its_breaker_and_others_serve(servers: list[FakeServer]) -> None:
    servers[0].status = 500
    client = await client_for([s.url for s in servers])
    try:
        outcomes = []
        for i in range(12):
            try:
                await client.predict(rows(i))
                outcomes.append("ok")
            except PredictionUnavailable as exc:
                outcomes.append(exc.reason)
        assert outcomes.count("http_500") == 3  # three strikes, then instance 0 is skipped
        assert outcomes[-4:] == ["ok"] * 4 and len(servers[0].calls) == 3
    finally:
        await client.close()


async def test_all_breakers_open_fails_fast_and_warming_up_does_not_trip(servers: list[FakeServer]) -> None:
    servers[0].status = 503
    clock = FakeClock()
    client = await client_for([servers[0].url], clock=clock, warmup_recheck_s=0.5)
    try:
        for _ in range(5):
            with pytest.raises(PredictionUnavailable, match="warming_up"):
                await client.predict(rows(1))
            clock.advance(0.5)
        assert len(servers[0].calls) == 5
        servers[0].status = 500
        for _ in range(3):
            with pytest.raises(PredictionUnavailable, match="http_500"):
                await client.predict(rows(1))
        calls = len(servers[0].calls)
        with pytest.raises(PredictionUnavailable, match="breaker_open"):
            await client.predict(rows(1))
        assert len(servers[0].calls) == calls
    finally:
        await client.close()


async def test_without_any_model_requests_are_answered_without_a_call(servers: list[FakeServer]) -> None:
    for server in servers:
        server.status = 503
    clock = FakeClock()
    client = await client_for([s.url for s in servers], clock=clock, warmup_recheck_s=0.5)
    try:
        for _ in range(6):
            with pytest.raises(PredictionUnavailable, match="warming_up"):
                await client.predict(rows(1))
        assert [len(s.calls) for s in servers] == [1, 1]  # each instance asked once
        servers[1].status = 200  # instance 1 loads a model
        clock.advance(0.4)
        with pytest.raises(PredictionUnavailable, match="warming_up"):
            await client.predict(rows(1))
        clock.advance(0.1)  # the recheck interval is over: both are asked again, in turn
        with pytest.raises(PredictionUnavailable, match="warming_up"):
            await client.predict(rows(1))  # instance 0 still has no model
        assert await client.predict(rows(3)) == [Prediction(3.0, 1.0)]  # instance 1 has one
        assert await client.predict(rows(4)) == [Prediction(4.0, 1.0)]  # instance 1 alone now
        assert [len(s.calls) for s in servers] == [2, 3]
    finally:
        await client.close()


async def test_training_samples_flush_in_bulk(servers: list[FakeServer]) -> None:
    client = await client_for([servers[0].url], trainer=servers[1].url, max_training_rows_per_flush=3)
    try:
        client.add_training([{"n": i} for i in range(5)])
        assert await client.flush_training() == 3
        assert await client.flush_training() == 2
        assert await client.flush_training() == 0
        assert [e["n"] for e in servers[1].training] == [0, 1, 2, 3, 4]
    finally:
        await client.close()


async def test_predictions_carry_the_model_version_and_a_retrain_request_reaches_the_trainer(
    servers: list[FakeServer],
) -> None:
    predictor, trainer = servers
    predictor.model_version = 4
    client = await client_for([predictor.url], trainer.url, trainer_token="s3cret")
    try:
        assert await client.predict(rows(5)) == [Prediction(5.0, 1.0, 4)]
        predictor.constant_models = "tpot"
        assert await client.predict(rows(5)) == [Prediction(5.0, 1.0, 4, ("tpot",))]
        client.request_retrain()
        async with asyncio.timeout(5):
            while not trainer.retrain_headers:
                await asyncio.sleep(0.01)
        assert trainer.retrain_headers == ["Bearer s3cret"]
    finally:
        await client.close()


async def test_rows_reach_the_predictor_as_sent(servers: list[FakeServer]) -> None:
    client = await client_for([servers[0].url])
    sent = feature_rows(5, seed=3)
    sent[2]["pod_type"] = "decode"
    try:
        await client.predict(sent)
        (matrix,) = servers[0].calls
        for row, values in zip(sent, matrix.tolist(), strict=True):
            row = {**row, "pod_type": POD_TYPES.index(row["pod_type"])}
            assert values == [row[name] for name in FEATURE_ROW_FIELDS]
    finally:
        await client.close()


async def test_an_answer_that_is_not_predictions_is_refused(servers: list[FakeServer]) -> None:
    servers[0].content_type = "application/json"
    client = await client_for([servers[0].url])
    try:
        with pytest.raises(PredictionUnavailable, match="bad_response"):
            await client.predict(rows(1, 2))
    finally:
        await client.close()


async def test_calls_one_after_another_reuse_one_connection_and_concurrent_ones_take_more(
    servers: list[FakeServer],
) -> None:
    servers[0].delay_s = 0.05
    client = await client_for([servers[0].url], coalesce_window_s=0.0)
    try:
        for n in range(3):
            await client.predict(rows(n))
        assert len(servers[0].calls) == 3 and len(servers[0].connections) == 1
        first = asyncio.ensure_future(client.predict(rows(1)))
        await asyncio.sleep(0.01)  # the first call is in flight: the next goes on its own
        await asyncio.gather(first, client.predict(rows(2)))
        assert len(servers[0].calls) == 5 and len(servers[0].connections) == 2
    finally:
        await client.close()


@pytest.mark.parametrize("url", ["https://127.0.0.1:8000", "http://127.0.0.1:8000/predict", "127.0.0.1:8000"])
async def test_a_sidecar_url_other_than_plain_http_host_and_port_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        await client_for([url])
