"""Model artifacts: atomic publication, versions, carry-over, pruning, verification."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import xgboost as xgb

from tests.trainer.synthetic import training_samples
from trainer import artifacts
from trainer.artifacts import (
    MANIFEST_NAME,
    ArtifactError,
    ArtifactStore,
    ModelInfo,
    NewModel,
    load_verified_booster,
    write_atomic,
)
from trainer.features import FEATURE_COLUMNS, TRAINING_SAMPLE_DECODER, matrix_from_columns
from trainer.settings import TrainingSettings
from trainer.training import HoldoutMetrics, train_model


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    columns = TRAINING_SAMPLE_DECODER.decode(training_samples(300))
    model = train_model(
        matrix_from_columns(columns),
        columns["actual_ttft_ms"],
        TrainingSettings(n_estimators=10),
        np.random.default_rng(0),
    )
    return bytes(model.booster.save_raw("ubj"))


def new_model(data: bytes) -> NewModel:
    return NewModel(
        data=data,
        objective="mean",
        quantile=None,
        target_transform="log",
        training_samples=270,
        holdout=HoldoutMetrics(samples=30, mape=0.05),
    )


def test_publish_writes_files_then_the_manifest(tmp_path: Path, model_bytes: bytes) -> None:
    store = ArtifactStore(tmp_path)
    manifest = store.publish({"ttft": new_model(model_bytes), "tpot": new_model(model_bytes)})
    assert manifest.version == 1
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert on_disk["version"] == 1
    for name in ("ttft", "tpot"):
        info = manifest.models[name]
        assert (tmp_path / info.file).read_bytes() == model_bytes
        assert info.size_bytes == len(model_bytes)
        assert info.feature_columns == FEATURE_COLUMNS
        assert info.holdout.mape == 0.05
        load_verified_booster(info, model_bytes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        MANIFEST_NAME,
        "tpot-v000001.ubj",
        "ttft-v000001.ubj",
    ]


def test_versions_increase_and_survive_a_restart(tmp_path: Path, model_bytes: bytes) -> None:
    store = ArtifactStore(tmp_path)
    assert store.current is None
    store.publish({"ttft": new_model(model_bytes)})
    store.publish({"ttft": new_model(model_bytes)})
    reopened = ArtifactStore(tmp_path)
    assert reopened.current is not None and reopened.current.version == 2
    assert reopened.publish({"ttft": new_model(model_bytes)}).version == 3


def test_a_model_not_retrained_is_carried_over(tmp_path: Path, model_bytes: bytes) -> None:
    store = ArtifactStore(tmp_path, keep_versions=1)
    store.publish({"ttft": new_model(model_bytes), "tpot": new_model(model_bytes)})
    manifest = store.publish({"ttft": new_model(model_bytes)})
    assert manifest.version == 2
    assert manifest.models["ttft"].version == 2
    assert manifest.models["tpot"].version == 1
    # keep_versions=1 prunes version 1, but not the TPOT file version 2 still uses.
    assert (tmp_path / "tpot-v000001.ubj").exists()
    assert not (tmp_path / "ttft-v000001.ubj").exists()
    assert store.read_model("tpot") == (1, model_bytes)


def test_old_versions_are_pruned_beyond_keep_versions(tmp_path: Path, model_bytes: bytes) -> None:
    store = ArtifactStore(tmp_path, keep_versions=2)
    for _ in range(4):
        store.publish({"ttft": new_model(model_bytes)})
    assert [(name, version) for name, version, _ in store.model_files()] == [("ttft", 3), ("ttft", 4)]
    assert store.read_model("ttft", version=3) == (3, model_bytes)
    with pytest.raises(ArtifactError):
        store.read_model("ttft", version=1)


def test_a_crash_while_writing_the_manifest_keeps_the_previous_one(
    tmp_path: Path, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path)
    store.publish({"ttft": new_model(model_bytes)})
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    real_replace = os.replace

    def crash_on_manifest(src: str, dst: str | Path) -> None:
        if Path(dst).name == MANIFEST_NAME:
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(artifacts.os, "replace", crash_on_manifest)
    with pytest.raises(OSError):
        store.publish({"ttft": new_model(b"new bytes")})
    monkeypatch.undo()
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before
    assert store.current is not None and store.current.version == 1
    reopened = ArtifactStore(tmp_path)
    assert reopened.current == store.current
    load_verified_booster(reopened.current.models["ttft"], reopened.read_model("ttft")[1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_crash_mid_file_write_leaves_no_partial_file(
    tmp_path: Path, model_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path)
    store.publish({"ttft": new_model(model_bytes)})

    def power_cut(fd: int) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(artifacts.os, "fsync", power_cut)
    with pytest.raises(OSError):
        store.publish({"ttft": new_model(model_bytes)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME, "ttft-v000001.ubj"]
    assert ArtifactStore(tmp_path).current.version == 1


def test_leftover_temp_files_are_removed_on_open(tmp_path: Path) -> None:
    (tmp_path / ".tmp-abc").write_bytes(b"half a model")
    ArtifactStore(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_replaces_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"one")
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.fixture
def info(tmp_path: Path, model_bytes: bytes) -> ModelInfo:
    return ArtifactStore(tmp_path).publish({"ttft": new_model(model_bytes)}).models["ttft"]


def test_verification_accepts_the_published_bytes(info: ModelInfo, model_bytes: bytes) -> None:
    booster = load_verified_booster(info, model_bytes)
    assert isinstance(booster, xgb.Booster)
    assert tuple(booster.feature_names) == FEATURE_COLUMNS


def test_truncated_bytes_fail_the_checksum(info: ModelInfo, model_bytes: bytes) -> None:
    with pytest.raises(ArtifactError) as caught:
        load_verified_booster(info, model_bytes[: len(model_bytes) // 2])
    assert caught.value.reason == "checksum"


def test_a_flipped_checksum_is_caught(info: ModelInfo, model_bytes: bytes) -> None:
    flipped = info.model_copy(update={"sha256": ("0" if info.sha256[0] != "0" else "1") + info.sha256[1:]})
    with pytest.raises(ArtifactError) as caught:
        load_verified_booster(flipped, model_bytes)
    assert caught.value.reason == "checksum"


def test_other_feature_columns_are_refused(info: ModelInfo, model_bytes: bytes) -> None:
    other = info.model_copy(update={"feature_columns": (*FEATURE_COLUMNS[:-1], "something_else")})
    with pytest.raises(ArtifactError) as caught:
        load_verified_booster(other, model_bytes)
    assert caught.value.reason == "columns"


def test_bytes_xgboost_cannot_load_are_refused(info: ModelInfo) -> None:
    garbage = b"not a model at all"
    matching = info.model_copy(update={"sha256": artifacts.sha256_hex(garbage), "size_bytes": len(garbage)})
    with pytest.raises(ArtifactError) as caught:
        load_verified_booster(matching, garbage)
    assert caught.value.reason == "load"


def test_a_booster_with_other_features_is_refused(info: ModelInfo) -> None:
    data = np.random.default_rng(0).random((50, 3)).astype(np.float32)
    booster = xgb.train({"max_depth": 2}, xgb.DMatrix(data, label=data[:, 0]), num_boost_round=2)
    raw = bytes(booster.save_raw("ubj"))
    matching = info.model_copy(update={"sha256": artifacts.sha256_hex(raw), "size_bytes": len(raw)})
    with pytest.raises(ArtifactError) as caught:
        load_verified_booster(matching, raw)
    assert caught.value.reason == "columns"


def test_a_corrupt_manifest_is_an_artifact_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ArtifactError) as caught:
        ArtifactStore(tmp_path)
    assert caught.value.reason == "manifest"
