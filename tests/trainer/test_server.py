"""The training server's HTTP API, in process: intake, validation, retraining, model downloads."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgboost as xgb

from tests.support import sample_value
from tests.trainer.running import Trainer, started
from tests.trainer.synthetic import training_samples, uncached_sweep, unexplained_tpot
from trainer.artifacts import Manifest
from trainer.features import FEATURE_COLUMNS, TRAINING_SAMPLE_DECODER, matrix_from_columns
from trainer.service import TrainerService
from trainer.settings import TrainerSettings


@pytest.fixture
async def trainer(tmp_path: Path) -> AsyncIterator[Trainer]:
    async for running in started(
        TrainerSettings(model_dir=tmp_path, retrain_interval_s=3600, min_samples=100)
    ):
        yield running


async def published(service: TrainerService, version: int = 1) -> Manifest:
    """The manifest once the trainer's own loop has published ``version`` and reported it in its
    metrics (fails after 60 s): the store shows a version fitted in the worker thread a moment
    before the loop reports it."""
    registry = service.metrics.registry
    async with asyncio.timeout(60):
        while (
            (current := service.store.current) is None
            or current.version < version
            or (registry.get_sample_value("trainer_model_version") or 0) < current.version
        ):
            await asyncio.sleep(0.01)
    return current


async def test_health_and_readiness(trainer: Trainer) -> None:
    client, _ = trainer
    assert (await client.get("/healthz")).status_code == 200
    assert (await client.get("/readyz")).status_code == 200


async def test_valid_samples_are_accepted_into_their_windows(trainer: Trainer) -> None:
    client, service = trainer
    samples = training_samples(10)
    samples[0]["actual_tpot_ms"] = 0.0  # a non-streaming request: TTFT only
    samples[1]["actual_ttft_ms"] = 0.0
    samples[1]["actual_tpot_ms"] = 0.0  # nothing measured: used by neither model
    response = await client.post("/add_training_data_bulk", json={"entries": samples})
    assert response.status_code == 202
    assert response.json() == {"accepted": 10}
    assert len(service.windows["ttft"]) == 9
    assert len(service.windows["tpot"]) == 8
    status = (await client.get("/data/status")).json()
    assert status["models"]["ttft"]["samples"] == 9
    assert sum(b["count"] for b in status["models"]["tpot"]["buckets"]) == 8
    text = (await client.get("/metrics")).text
    assert sample_value(text, "trainer_samples_total", destination="unused") == 1.0
    assert sample_value(text, "trainer_window_samples", model="ttft") == 9.0


BAD_SAMPLES: list[tuple[str, str, Any, str]] = [
    ("nan", "actual_ttft_ms", float("nan"), "not_finite"),
    ("infinity", "kv_cache_percentage", float("inf"), "not_finite"),
    ("negative", "actual_tpot_ms", -1.0, "out_of_range"),
    ("negative count", "num_request_waiting", -3, "out_of_range"),
    ("above range", "kv_cache_percentage", 1.5, "out_of_range"),
    ("latency too large", "actual_ttft_ms", 1e12, "out_of_range"),
    ("string number", "input_token_length", "100", "wrong_type"),
    ("float for int", "num_request_running", 2.0, "wrong_type"),
    ("bool", "num_request_running", True, "wrong_type"),
    ("null", "prefix_cache_score", None, "wrong_type"),
    ("bad pod type", "pod_type", "gpu", "wrong_type"),
    ("unknown field", "colour", "blue", "unknown_field"),
]


@pytest.mark.parametrize(("case", "field", "value", "reason"), BAD_SAMPLES, ids=[c[0] for c in BAD_SAMPLES])
async def test_every_bad_sample_class_is_refused_and_counted(
    trainer: Trainer, case: str, field: str, value: Any, reason: str
) -> None:
    client, service = trainer
    samples = training_samples(5)
    samples[2][field] = value
    # json.dumps writes NaN and Infinity as the tokens Python's (and many) JSON parsers accept.
    response = await client.post("/add_training_data_bulk", content=json.dumps({"entries": samples}))
    assert response.status_code == 422
    body = response.json()
    assert body["errors"] == [{"index": 2, "field": field, "error": body["errors"][0]["error"]}]
    assert len(service.windows["ttft"]) == 0  # all or nothing: the 4 good samples were refused too
    text = (await client.get("/metrics")).text
    assert sample_value(text, "trainer_rejected_samples_total", reason=reason) == 1.0
    assert sample_value(text, "trainer_rejected_samples_total", reason="batch_rejected") == 4.0


async def test_missing_fields_and_non_objects_are_refused(trainer: Trainer) -> None:
    client, service = trainer
    samples: list[Any] = training_samples(4)
    del samples[1]["actual_ttft_ms"]
    samples[3] = "a string"
    response = await client.post("/add_training_data_bulk", json={"entries": samples})
    assert response.status_code == 422
    assert [(e["index"], e["field"]) for e in response.json()["errors"]] == [(1, "actual_ttft_ms"), (3, "")]
    assert response.json()["error_count"] == 2
    text = (await client.get("/metrics")).text
    assert sample_value(text, "trainer_rejected_samples_total", reason="missing_field") == 1.0
    assert sample_value(text, "trainer_rejected_samples_total", reason="wrong_type") == 1.0
    assert len(service.windows["ttft"]) == 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[]", 422),
        (b'{"entries": {}}', 422),
        (b'{"entries": [], "extra": 1}', 422),
    ],
)
async def test_malformed_bodies(trainer: Trainer, body: bytes, status: int) -> None:
    client, _ = trainer
    response = await client.post("/add_training_data_bulk", content=body)
    assert response.status_code == status
    assert "detail" in response.json()


async def test_an_empty_bulk_is_accepted(trainer: Trainer) -> None:
    client, _ = trainer
    response = await client.post("/add_training_data_bulk", json={"entries": []})
    assert (response.status_code, response.json()) == (202, {"accepted": 0})


async def test_an_oversized_body_gets_413(tmp_path: Path) -> None:
    async for client, _ in started(TrainerSettings(model_dir=tmp_path, max_body_bytes=2048)):
        response = await client.post("/add_training_data_bulk", json={"entries": training_samples(50)})
        assert response.status_code == 413
        assert "larger than 2048" in response.json()["detail"]
        text = (await client.get("/metrics")).text
        assert sample_value(text, "trainer_rejected_requests_total", reason="too_large") == 1.0


async def test_model_endpoints_before_any_training(trainer: Trainer) -> None:
    client, _ = trainer
    assert (await client.get("/model/download/info")).status_code == 404
    assert (await client.get("/model/ttft/info")).status_code == 404
    assert (await client.get("/model/ttft/download")).status_code == 404
    assert (await client.get("/models/list")).json() == {"version": None, "models": []}


async def test_retraining_publishes_downloadable_models(trainer: Trainer) -> None:
    client, service = trainer
    await client.post("/add_training_data_bulk", json={"entries": training_samples(1500)})
    manifest = await published(service)  # the first fit does not wait for the retrain interval
    assert manifest.version == 1
    assert set(manifest.models) == {"ttft", "tpot"}

    info = (await client.get("/model/download/info")).json()
    assert info["version"] == 1
    ttft = (await client.get("/model/ttft/info")).json()
    assert ttft["sha256"] == info["models"]["ttft"]["sha256"]
    assert ttft["last_modified"]
    assert ttft["holdout"]["mape"] < 0.05

    download = await client.get("/model/ttft/download")
    assert download.status_code == 200
    assert download.headers["x-model-version"] == "1"
    assert (
        download.headers["x-model-sha256"] == hashlib.sha256(download.content).hexdigest() == ttft["sha256"]
    )
    assert (await client.get("/model/ttft/download", params={"version": 1})).content == download.content
    assert (await client.get("/model/ttft/download", params={"version": 7})).status_code == 404
    assert (await client.get("/model/latency/info")).status_code == 404
    assert (await client.get("/model/latency/download")).status_code == 404

    listed = (await client.get("/models/list")).json()
    assert listed["version"] == 1
    assert {(m["name"], m["version"], m["current"]) for m in listed["models"]} == {
        ("ttft", 1, True),
        ("tpot", 1, True),
    }

    text = (await client.get("/metrics")).text
    assert sample_value(text, "trainer_model_version") == 1.0
    assert 0 < sample_value(text, "trainer_model_mape", model="ttft") < 0.05
    assert sample_value(text, "trainer_model_training_samples", model="tpot") == 1350.0
    assert sample_value(text, "trainer_retrain_duration_seconds_count", model="ttft") == 1.0


async def test_retraining_waits_for_min_samples_and_new_data(trainer: Trainer) -> None:
    client, service = trainer
    await client.post("/add_training_data_bulk", json={"entries": training_samples(99)})
    assert not service.first_fit_due
    assert await service.retrain() is None  # below min_samples
    await client.post("/add_training_data_bulk", json={"entries": training_samples(1, seed=5)})
    assert (await published(service)).version == 1  # fitted at once, not after the 1-hour interval
    assert not service.first_fit_due
    assert await service.retrain() is None  # nothing new since
    await client.post("/add_training_data_bulk", json={"entries": training_samples(10, seed=6)})
    assert not service.first_fit_due  # later versions wait for the interval (or a call)
    assert (await service.retrain()).version == 2


async def test_only_ttft_samples_count_towards_the_first_fit(trainer: Trainer) -> None:
    client, service = trainer
    tpot_only = training_samples(150)
    for sample in tpot_only[:60]:
        sample["actual_ttft_ms"] = 0.0
    await client.post("/add_training_data_bulk", json={"entries": tpot_only})
    assert len(service.windows["tpot"]) == 150 and len(service.windows["ttft"]) == 90
    assert not service.first_fit_due
    await client.post("/add_training_data_bulk", json={"entries": training_samples(10, seed=7)})
    assert service.first_fit_due
    manifest = await published(service)
    ttft = manifest.models["ttft"]
    # 100 samples: a 10% holdout would be 10, so every sample is fitted and cross-validated
    assert ttft.training_samples == ttft.holdout.samples == 100 and ttft.holdout.folds == 5


async def test_a_first_model_no_better_than_a_constant_is_withheld(trainer: Trainer) -> None:
    client, service = trainer
    samples = training_samples(300, seed=1)
    rng = np.random.default_rng(1)
    for sample in samples:  # 100 ms, with one in ten a stall that no feature explains
        sample["actual_ttft_ms"] = float(rng.uniform(1000, 10_000)) if rng.random() < 0.1 else 100.0
    await client.post("/add_training_data_bulk", json={"entries": samples})
    async with asyncio.timeout(60):
        while not sample_value(
            (await client.get("/metrics")).text, "trainer_models_withheld_total", model="ttft"
        ):
            await asyncio.sleep(0.01)
    assert service.store.current is None  # the TPOT model alone is no version
    assert (await client.get("/model/download/info")).status_code == 404
    assert service.first_fit_due  # still: the next samples try again
    await client.post("/add_training_data_bulk", json={"entries": training_samples(2000, seed=2)})
    manifest = await published(service)
    ttft = manifest.models["ttft"].holdout
    assert ttft.baseline_loss is not None and ttft.mape is not None and ttft.mape < ttft.baseline_loss


async def test_a_tpot_model_no_better_than_a_constant_is_replaced_by_it(trainer: Trainer) -> None:
    """Decoding speed that no feature explains (a light load): the trees are withheld and the
    trainer serves the median TPOT, not no TPOT model (which the predictors answer as 0)."""
    client, service = trainer
    await client.post("/add_training_data_bulk", json={"entries": unexplained_tpot(300)})
    manifest = await published(service)
    text = (await client.get("/metrics")).text
    assert sample_value(text, "trainer_models_withheld_total", model="tpot") == 1
    tpot = manifest.models["tpot"]
    assert tpot.holdout.baseline_loss is not None and tpot.holdout.loss == tpot.holdout.baseline_loss
    booster = xgb.Booster()
    booster.load_model(bytearray((await client.get("/model/tpot/download")).content))
    assert np.exp(booster.inplace_predict(np.zeros((1, len(FEATURE_COLUMNS)), np.float32))) == pytest.approx(
        20.0
    )


async def test_no_version_without_a_ttft_model(trainer: Trainer) -> None:
    client, service = trainer
    samples = training_samples(200)
    for sample in samples:
        sample["actual_ttft_ms"] = 0.0
    await client.post("/add_training_data_bulk", json={"entries": samples})
    assert await service.retrain() is None


async def test_tpot_is_optional(trainer: Trainer) -> None:
    client, service = trainer
    samples = training_samples(200)
    for sample in samples:
        sample["actual_tpot_ms"] = 0.0
    await client.post("/add_training_data_bulk", json={"entries": samples})
    manifest = await published(service)
    assert set(manifest.models) == {"ttft"}
    assert (await client.get("/model/tpot/info")).status_code == 404


async def test_quantile_models_report_pinball_loss_and_coverage(tmp_path: Path) -> None:
    settings = TrainerSettings(model_dir=tmp_path, objective="quantile", quantile_alpha=0.8, min_samples=100)
    async for client, service in started(settings):
        await client.post("/add_training_data_bulk", json={"entries": training_samples(1000)})
        manifest = await published(service)
        info = manifest.models["ttft"]
        assert (info.objective, info.quantile) == ("quantile", 0.8)
        assert info.holdout.pinball_loss is not None and info.holdout.coverage is not None
        text = (await client.get("/metrics")).text
        assert sample_value(text, "trainer_model_coverage", model="ttft") == pytest.approx(
            info.holdout.coverage
        )
        assert sample_value(text, "trainer_model_mape", model="ttft") is None


async def test_a_restarted_trainer_keeps_serving_and_counting_versions(tmp_path: Path) -> None:
    settings = TrainerSettings(model_dir=tmp_path, min_samples=100)
    async for client, service in started(settings):
        await client.post("/add_training_data_bulk", json={"entries": training_samples(300)})
        await published(service)
    async for client, service in started(settings):
        assert (await client.get("/model/download/info")).json()["version"] == 1
        await client.post("/add_training_data_bulk", json={"entries": training_samples(300)})
        assert not service.first_fit_due  # it has a model: no first fit to hurry
        assert (await service.retrain()).version == 2


async def test_a_retrain_request_refits_on_new_samples_only_and_each_version_keeps_its_holdout_error(
    tmp_path: Path,
) -> None:
    settings = TrainerSettings(model_dir=tmp_path, retrain_interval_s=3600, min_samples=100, keep_versions=2)
    async for client, service in started(settings):
        await client.post("/add_training_data_bulk", json={"entries": training_samples(300)})
        await published(service, 1)
        for version, seed in ((2, 11), (3, 12)):
            response = await client.post("/retrain")
            assert (response.status_code, response.json()) == (202, {"retrain": "requested"})
            # The old samples are forgotten; 99 new ones are not enough for a fit ...
            status = (await client.get("/data/status")).json()["models"]
            assert status["ttft"]["samples"] == status["tpot"]["samples"] == 0
            fresh = training_samples(100, seed=seed)
            await client.post("/add_training_data_bulk", json={"entries": fresh[:99]})
            assert not service.fit_due
            # ... 100 are, at once, not after the one-hour interval: fitted on those alone.
            await client.post("/add_training_data_bulk", json={"entries": fresh[99:]})
            manifest = await published(service, version)
            ttft = manifest.models["ttft"]
            assert ttft.version == version and ttft.training_samples <= 100  # none of the 300 forgotten
        holdout = "trainer_model_version_holdout_error"
        async with asyncio.timeout(10):  # reported just after the manifest is published
            while (
                sample_value(text := (await client.get("/metrics")).text, holdout, model="ttft", version="3")
                is None
            ):
                await asyncio.sleep(0.01)
        assert sample_value(text, "trainer_retrain_requests_total") == 2.0
        errors = {v: sample_value(text, holdout, model="ttft", version=str(v)) for v in (1, 2, 3)}
        # Only the kept versions have a series, each its own version's holdout MAPE.
        assert errors[1] is None
        assert errors[3] == manifest.models["ttft"].holdout.mape
        assert errors[2] is not None and 0 < errors[2] < 0.5


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_served_ttft_model_is_monotone_unless_turned_off(tmp_path: Path, enabled: bool) -> None:
    service = TrainerService(TrainerSettings(model_dir=tmp_path, ttft_monotone=enabled))
    samples = training_samples(300, seed=3, noise=0.5)  # small and noisy, where trees wander most
    service.add_samples(samples)
    assert await service.retrain() is not None
    booster = xgb.Booster(model_file=bytearray(service.store.read_model("ttft")[1]))
    features = matrix_from_columns(TRAINING_SAMPLE_DECODER.decode(samples))
    steps = np.diff(booster.inplace_predict(uncached_sweep(features)))
    assert bool(np.all(steps >= 0)) is enabled
