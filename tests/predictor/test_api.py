"""The prediction server's HTTP API, in process, on a model directory."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from unittest.mock import ANY

import httpx
import numpy as np
import pytest

from predictor.models import ModelSet, build_model_set
from predictor.reload import ModelReloader
from predictor.server import create_app
from predictor.settings import PredictorSettings
from tests.support import sample_value
from tests.trainer.synthetic import (
    feature_rows,
    publish_version,
    training_samples,
    true_ttft_ms,
    unexplained_tpot,
)
from trainer.artifacts import Manifest
from trainer.features import decode_feature_rows
from trainer.service import TrainerService
from trainer.settings import TrainerSettings
from wire.latency_binary import (
    CONSTANT_MODELS_HEADER,
    FEATURE_ROW_FIELDS,
    FEATURE_ROWS_TYPE,
    MODEL_VERSION_HEADER,
    PREDICTIONS_TYPE,
    ROW_BYTES,
    decode_predictions,
    decode_rows,
    encode_rows,
)


async def running(settings: PredictorSettings) -> AsyncIterator[tuple[httpx.AsyncClient, ModelReloader]]:
    """A predictor app (lifespan started) and its reloader; tests poll the reloader themselves."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://predictor") as client:
            yield client, app.state.reloader


async def loaded(settings: PredictorSettings) -> AsyncIterator[httpx.AsyncClient]:
    async for client, reloader in running(settings):
        assert await reloader.poll_once()
        yield client


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    asyncio.run(publish_version(directory, n=3000))
    return directory


@pytest.fixture
async def client(model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for c in loaded(PredictorSettings(model_dir=model_dir, poll_interval_s=3600)):
        yield c


async def test_not_ready_until_a_model_is_loaded(tmp_path: Path) -> None:
    async for client, reloader in running(PredictorSettings(model_dir=tmp_path, poll_interval_s=3600)):
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 503
        response = await client.post("/predict/bulk/strict", json={"requests": feature_rows(2)})
        assert response.status_code == 503
        assert (await client.get("/status")).json()["ready"] is False
        await publish_version(tmp_path, n=300)
        assert await reloader.poll_once()
        assert (await client.get("/readyz")).status_code == 200


async def test_strict_predictions(client: httpx.AsyncClient, model_dir: Path) -> None:
    rows = feature_rows(100, seed=7)
    response = await client.post("/predict/bulk/strict", json={"requests": rows})
    assert response.status_code == 200
    body = response.json()
    assert body["total_requests"] == 100
    assert body["model_version"] == 1 and body["constant_models"] == []
    assert body["processing_time_ms"] >= 0
    first = body["predictions"][0]
    assert set(first) == {"ttft_ms", "tpot_ms", "model_type", "quantile", "last_model_load"}
    assert (first["model_type"], first["quantile"]) == ("xgboost", None)
    datetime.fromisoformat(first["last_model_load"])
    # The served numbers are the model's, to the 3 decimals sent.
    ttft, tpot = _served_models(model_dir).predict(decode_feature_rows(rows))
    assert [p["ttft_ms"] for p in body["predictions"]] == pytest.approx(ttft.tolist(), abs=1e-3)
    assert [p["tpot_ms"] for p in body["predictions"]] == pytest.approx(tpot.tolist(), abs=1e-3)
    # ... and they are good predictions of the known function.
    actual = np.array([true_ttft_ms(r) for r in rows])
    assert np.mean(np.abs(ttft - actual) / actual) < 0.05


async def test_strict_refuses_the_whole_call_for_one_bad_row(client: httpx.AsyncClient) -> None:
    rows = feature_rows(10)
    rows[6]["num_request_waiting"] = -1
    response = await client.post("/predict/bulk/strict", json={"requests": rows})
    assert response.status_code == 422
    body = response.json()
    assert body["errors"][0]["index"] == 6
    assert body["errors"][0]["field"] == "num_request_waiting"
    assert "predictions" not in body


async def test_bulk_reports_errors_per_row(client: httpx.AsyncClient) -> None:
    rows: list[object] = list(feature_rows(5))
    rows[1] = {**rows[1], "kv_cache_percentage": "high"}  # type: ignore[dict-item]
    rows[3] = 42
    response = await client.post("/predict/bulk", json={"requests": rows})
    assert response.status_code == 200
    body = response.json()
    assert [p is None for p in body["predictions"]] == [False, True, False, True, False]
    assert [e["index"] for e in body["errors"]] == [1, 3]
    assert "kv_cache_percentage" in body["errors"][0]["error"]
    strict = await client.post("/predict/bulk/strict", json={"requests": [rows[0], rows[2], rows[4]]})
    good = [p for p in body["predictions"] if p is not None]
    assert [p["ttft_ms"] for p in good] == [p["ttft_ms"] for p in strict.json()["predictions"]]


@pytest.mark.parametrize("endpoint", ["/predict/bulk/strict", "/predict/bulk"])
@pytest.mark.parametrize("count", [0, 10_001])
async def test_row_count_limits(client: httpx.AsyncClient, endpoint: str, count: int) -> None:
    rows = feature_rows(1) * count
    response = await client.post(endpoint, json={"requests": rows})
    assert response.status_code == 422
    assert "1 to 10000 rows" in response.json()["detail"]


async def test_the_largest_call_is_served(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict/bulk/strict", json={"requests": feature_rows(10_000)})
    assert response.status_code == 200
    assert response.json()["total_requests"] == 10_000


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"nope", 400), (b"[]", 422), (b'{"rows": []}', 422), (b'{"requests": {}}', 422)],
)
async def test_malformed_bodies(client: httpx.AsyncClient, body: bytes, status: int) -> None:
    assert (await client.post("/predict/bulk/strict", content=body)).status_code == status


async def test_oversized_bodies_get_413(model_dir: Path) -> None:
    settings = PredictorSettings(model_dir=model_dir, poll_interval_s=3600, max_body_bytes=4096)
    async for client in loaded(settings):
        response = await client.post(
            "/predict/bulk/strict", content=json.dumps({"requests": feature_rows(100)})
        )
        assert response.status_code == 413


async def test_status_and_metrics(client: httpx.AsyncClient) -> None:
    await client.post("/predict/bulk/strict", json={"requests": feature_rows(3)})
    status = (await client.get("/status")).json()
    assert status["ready"] is True
    assert status["model_version"] == 1
    assert status["source"].startswith("directory ")
    assert status["models"]["ttft"]["version"] == 1
    assert status["models"]["tpot"]["objective"] == "mean"
    assert status["counts"]["model_loads"] == 1
    assert status["counts"]["rows_predicted"] == 3
    assert status["counts"]["calls_ok"] == 1
    text = (await client.get("/metrics")).text
    assert sample_value(text, "predictor_model_version") == 1.0
    assert sample_value(text, "predictor_calls_total", endpoint="strict", outcome="ok") == 1.0


async def test_without_a_tpot_model_tpot_is_zero(tmp_path: Path) -> None:
    service = TrainerService(TrainerSettings(model_dir=tmp_path))
    samples = training_samples(300)
    for sample in samples:
        sample["actual_tpot_ms"] = 0.0
    service.add_samples(samples)
    await service.retrain()
    async for client in loaded(PredictorSettings(model_dir=tmp_path, poll_interval_s=3600)):
        body = (await client.post("/predict/bulk/strict", json={"requests": feature_rows(4)})).json()
        assert [p["tpot_ms"] for p in body["predictions"]] == [0.0] * 4
        assert all(p["ttft_ms"] > 0 for p in body["predictions"])
        assert (await client.get("/status")).json()["models"]["tpot"] is None


async def test_quantile_models_say_their_quantile(tmp_path: Path) -> None:
    await publish_version(tmp_path, n=300, objective="quantile", quantile_alpha=0.9)
    async for client in loaded(PredictorSettings(model_dir=tmp_path, poll_interval_s=3600)):
        body = (await client.post("/predict/bulk/strict", json={"requests": feature_rows(2)})).json()
        assert [p["quantile"] for p in body["predictions"]] == [0.9, 0.9]


async def test_non_finite_numbers_are_refused_by_field(client: httpx.AsyncClient) -> None:
    rows = feature_rows(3)
    rows[2]["kv_cache_percentage"] = float("nan")  # json.dumps writes the NaN token
    response = await client.post("/predict/bulk/strict", content=json.dumps({"requests": rows}))
    assert response.status_code == 422
    assert response.json()["errors"][0] == {"index": 2, "field": "kv_cache_percentage", "error": ANY}


async def test_other_methods_on_prediction_routes_get_405(client: httpx.AsyncClient) -> None:
    for endpoint in ("/predict/bulk/strict", "/predict/bulk"):
        response = await client.get(endpoint)
        assert response.status_code == 405
        assert response.json() == {"detail": "Method Not Allowed"}


async def test_an_unexpected_error_is_a_json_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: ModelSet, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise RuntimeError("boom")

    monkeypatch.setattr(ModelSet, "predict", broken)
    response = await client.post("/predict/bulk/strict", json={"requests": feature_rows(2)})
    assert response.status_code == 500
    assert response.json() == {"detail": "internal error: RuntimeError"}


BINARY = {"content-type": FEATURE_ROWS_TYPE}


def _served_models(model_dir: Path) -> ModelSet:
    """The models of ``model_dir``'s current version, as a predictor loads them."""
    manifest = Manifest.model_validate_json((model_dir / "manifest.json").read_bytes())
    return build_model_set(
        manifest,
        {n: (model_dir / i.file).read_bytes() for n, i in manifest.models.items()},
        loaded_at=datetime.now(UTC),
        source="test",
    )


async def test_binary_calls_get_the_models_numbers(client: httpx.AsyncClient, model_dir: Path) -> None:
    rows = feature_rows(100, seed=7)
    response = await client.post("/predict/bulk/strict", content=encode_rows(rows), headers=BINARY)
    assert response.status_code == 200
    assert response.headers["content-type"] == PREDICTIONS_TYPE
    assert response.headers[MODEL_VERSION_HEADER] == "1"
    assert CONSTANT_MODELS_HEADER not in response.headers
    ttft, tpot = _served_models(model_dir).predict(decode_feature_rows(rows))
    assert decode_predictions(response.content) == np.column_stack((ttft, tpot)).tolist()  # exactly
    as_json = (await client.post("/predict/bulk/strict", json={"requests": rows})).json()["predictions"]
    assert [p["ttft_ms"] for p in as_json] == pytest.approx(ttft.tolist(), abs=1e-3)


async def test_a_constant_tpot_model_is_named_in_both_forms_of_the_answer(tmp_path: Path) -> None:
    service = TrainerService(TrainerSettings(model_dir=tmp_path))
    service.add_samples(unexplained_tpot(300))
    assert await service.retrain() is not None
    rows = feature_rows(20, seed=3)
    async for client in loaded(PredictorSettings(model_dir=tmp_path, poll_interval_s=3600)):
        binary = await client.post("/predict/bulk/strict", content=encode_rows(rows), headers=BINARY)
        assert binary.headers[CONSTANT_MODELS_HEADER] == "tpot"
        assert {round(tpot, 3) for _, tpot in decode_predictions(binary.content)} == {20.0}
        as_json = (await client.post("/predict/bulk/strict", json={"requests": rows})).json()
        assert as_json["constant_models"] == ["tpot"]
        assert len({p["ttft_ms"] for p in as_json["predictions"]}) > 10  # the TTFT model has trees


async def test_a_bad_binary_row_is_refused_by_row_and_field(client: httpx.AsyncClient) -> None:
    matrix = decode_rows(encode_rows(feature_rows(10))).copy()
    matrix[6, FEATURE_ROW_FIELDS.index("num_request_waiting")] = 2.5
    response = await client.post("/predict/bulk/strict", content=matrix.tobytes(), headers=BINARY)
    assert response.status_code == 422
    assert response.json()["errors"] == [
        {"index": 6, "field": "num_request_waiting", "error": "Input should be a valid integer"}
    ]
    text = (await client.get("/metrics")).text
    assert sample_value(text, "predictor_calls_total", endpoint="strict", outcome="invalid") == 1.0


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        (b"\0" * (ROW_BYTES + 1), 400, f"{ROW_BYTES} bytes each"),
        (b"", 422, "1 to 10000 rows, not 0"),
        (b"\0" * ROW_BYTES * 10_001, 422, "1 to 10000 rows, not 10001"),
    ],
)
async def test_malformed_binary_bodies(
    client: httpx.AsyncClient, body: bytes, status: int, detail: str
) -> None:
    response = await client.post("/predict/bulk/strict", content=body, headers=BINARY)
    assert response.status_code == status
    assert detail in response.json()["detail"]


async def test_binary_bodies_are_for_the_strict_route(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict/bulk", content=encode_rows(feature_rows(2)), headers=BINARY)
    assert response.status_code == 415
    assert "/predict/bulk/strict" in response.json()["detail"]


async def test_oversized_binary_bodies_get_413(model_dir: Path) -> None:
    settings = PredictorSettings(model_dir=model_dir, poll_interval_s=3600, max_body_bytes=4096)
    async for client in loaded(settings):
        body = encode_rows(feature_rows(100))
        response = await client.post("/predict/bulk/strict", content=body, headers=BINARY)
        assert response.status_code == 413
        assert "4096 bytes" in response.json()["detail"]


async def test_binary_calls_answer_503_until_a_model_and_then_the_new_version(tmp_path: Path) -> None:
    body = encode_rows(feature_rows(3))
    async for client, reloader in running(PredictorSettings(model_dir=tmp_path, poll_interval_s=3600)):
        response = await client.post("/predict/bulk/strict", content=body, headers=BINARY)
        assert response.status_code == 503
        assert response.json() == {"detail": "no model loaded yet"}
        await publish_version(tmp_path, n=300, seed=1, n_estimators=20)
        assert await reloader.poll_once()
        first = await client.post("/predict/bulk/strict", content=body, headers=BINARY)
        assert first.headers[MODEL_VERSION_HEADER] == "1"
        await publish_version(tmp_path, n=300, seed=2, n_estimators=20)
        assert await reloader.poll_once()
        second = await client.post("/predict/bulk/strict", content=body, headers=BINARY)
        assert second.headers[MODEL_VERSION_HEADER] == "2"
        assert decode_predictions(second.content) != decode_predictions(first.content)
