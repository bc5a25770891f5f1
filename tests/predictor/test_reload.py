"""Hot reload from a directory and from the trainer over HTTP; corrupt artifacts are never served."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from predictor.metrics import PredictorMetrics
from predictor.reload import DirectorySource, ModelReloader, TrainerSource
from tests.support import serving
from tests.trainer.synthetic import feature_rows, publish_version, training_samples
from trainer.artifacts import MANIFEST_NAME, Manifest
from trainer.features import decode_feature_rows
from trainer.server import create_app as create_trainer_app
from trainer.settings import TrainerSettings

FAST = {"n_estimators": 20}
"""Reload tests need models, not good ones."""


def failures(metrics: PredictorMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("predictor_model_load_failures_total", {"reason": reason}) or 0.0


def reloader_for(model_dir: Path) -> ModelReloader:
    return ModelReloader(DirectorySource(model_dir), PredictorMetrics(), poll_interval_s=3600)


def edit_manifest(model_dir: Path, change: Any) -> None:
    path = model_dir / MANIFEST_NAME
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


async def test_a_new_version_is_swapped_in_whole(tmp_path: Path) -> None:
    reloader = reloader_for(tmp_path)
    assert not await reloader.poll_once()  # nothing published yet
    assert reloader.current is None
    await publish_version(tmp_path, n=300, seed=1, **FAST)
    assert await reloader.poll_once()
    first = reloader.current
    assert first is not None and first.version == 1
    assert not await reloader.poll_once()  # unchanged
    await publish_version(tmp_path, n=300, seed=2, **FAST)
    assert await reloader.poll_once()
    second = reloader.current
    assert second is not None and second.version == 2
    assert (second.ttft.info.version, second.tpot.info.version) == (2, 2)
    features = decode_feature_rows(feature_rows(5))
    assert not (first.predict(features)[0] == second.predict(features)[0]).all()


class CountingSource(DirectorySource):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.polls = 0

    async def manifest(self) -> Manifest | None:
        self.polls += 1
        return await super().manifest()


async def test_the_first_model_is_found_within_seconds_whatever_the_poll_interval(tmp_path: Path) -> None:
    source = CountingSource(tmp_path)
    reloader = ModelReloader(source, PredictorMetrics(), poll_interval_s=3600)  # hourly once serving
    task = asyncio.create_task(reloader.run_forever())
    try:
        async with asyncio.timeout(30):
            while source.polls == 0:  # its first poll finds nothing
                await asyncio.sleep(0.01)
            await publish_version(tmp_path, n=300, seed=1, **FAST)
            while reloader.current is None:
                await asyncio.sleep(0.01)
        assert reloader.current.version == 1 and source.polls >= 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def truncate_ttft(model_dir: Path, manifest: Manifest) -> None:
    path = model_dir / manifest.models["ttft"].file
    path.write_bytes(path.read_bytes()[:1000])


def flip_checksum(model_dir: Path, manifest: Manifest) -> None:
    def change(document: dict[str, Any]) -> None:
        sha = document["models"]["tpot"]["sha256"]
        document["models"]["tpot"]["sha256"] = ("0" if sha[0] != "0" else "1") + sha[1:]

    edit_manifest(model_dir, change)


def other_feature_columns(model_dir: Path, manifest: Manifest) -> None:
    def change(document: dict[str, Any]) -> None:
        document["models"]["ttft"]["feature_columns"] = [
            *document["models"]["ttft"]["feature_columns"][:-1],
            "x",
        ]

    edit_manifest(model_dir, change)


def delete_tpot(model_dir: Path, manifest: Manifest) -> None:
    (model_dir / manifest.models["tpot"].file).unlink()


def garble_manifest(model_dir: Path, manifest: Manifest) -> None:
    (model_dir / MANIFEST_NAME).write_text('{"version": "three"')


CORRUPTIONS = [
    (truncate_ttft, "checksum"),
    (flip_checksum, "checksum"),
    (other_feature_columns, "columns"),
    (delete_tpot, "missing"),
    (garble_manifest, "manifest"),
]


@pytest.mark.parametrize(("corrupt", "reason"), CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
async def test_a_corrupt_version_is_never_served(tmp_path: Path, corrupt: Any, reason: str) -> None:
    reloader = reloader_for(tmp_path)
    await publish_version(tmp_path, n=300, seed=1, **FAST)
    assert await reloader.poll_once()
    good = reloader.current
    bad = await publish_version(tmp_path, n=300, seed=2, **FAST)
    corrupt(tmp_path, bad)
    for _ in range(2):
        assert not await reloader.poll_once()
        assert reloader.current is good  # the last good version keeps serving, both models of it
    assert failures(reloader.metrics, reason) == 2
    assert reloader.failures == 2
    # A good version after the bad one is taken (the trainer needs a readable manifest to go on).
    (tmp_path / MANIFEST_NAME).write_text(bad.model_dump_json())
    await publish_version(tmp_path, n=300, seed=3, **FAST)
    assert await reloader.poll_once()
    assert reloader.current is not None and reloader.current.version == 3


async def test_a_corrupt_first_version_leaves_the_predictor_unready(tmp_path: Path) -> None:
    reloader = reloader_for(tmp_path)
    manifest = await publish_version(tmp_path, n=300, **FAST)
    truncate_ttft(tmp_path, manifest)
    assert not await reloader.poll_once()
    assert reloader.current is None


async def test_reload_over_http_from_the_training_server(tmp_path: Path) -> None:
    trainer_app = create_trainer_app(
        TrainerSettings(model_dir=tmp_path, retrain_interval_s=3600, min_samples=100, **FAST)
    )
    service = trainer_app.state.service
    async with serving(trainer_app) as url:
        reloader = ModelReloader(TrainerSource(url), PredictorMetrics(), poll_interval_s=3600)
        assert not await reloader.poll_once()  # 404: nothing trained yet, not a failure
        assert reloader.failures == 0
        service.add_samples(training_samples(300, seed=1))
        await service.retrain()
        assert await reloader.poll_once()
        assert reloader.current is not None and reloader.current.version == 1
        assert reloader.current.source == f"trainer {url}"

        # The trainer serves a corrupt file for version 2: the predictor keeps version 1.
        service.add_samples(training_samples(300, seed=2))
        bad = await service.retrain()
        truncate_ttft(tmp_path, bad)
        assert not await reloader.poll_once()
        assert reloader.current.version == 1
        assert failures(reloader.metrics, "checksum") == 1

        service.add_samples(training_samples(300, seed=3))
        await service.retrain()
        assert await reloader.poll_once()
        assert reloader.current.version == 3
        await reloader.source.close()


async def test_an_unreachable_trainer_keeps_the_last_model(tmp_path: Path) -> None:
    trainer_app = create_trainer_app(
        TrainerSettings(model_dir=tmp_path, retrain_interval_s=3600, min_samples=100, **FAST)
    )
    service = trainer_app.state.service
    service.add_samples(training_samples(300))
    await service.retrain()
    async with serving(trainer_app) as url:
        reloader = ModelReloader(TrainerSource(url, timeout_s=2.0), PredictorMetrics(), poll_interval_s=3600)
        assert await reloader.poll_once()
    # The trainer is gone now.
    assert not await reloader.poll_once()
    assert reloader.current is not None and reloader.current.version == 1
    assert failures(reloader.metrics, "fetch") == 1
    await reloader.source.close()
