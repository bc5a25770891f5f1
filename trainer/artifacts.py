"""Model artifacts on disk: versioned XGBoost files plus a manifest, written atomically.

Layout of the model directory (a shared volume in Kubernetes)::

    ttft-v000012.ubj    the TTFT booster of version 12 (XGBoost UBJSON, ``Booster.save_raw``)
    tpot-v000012.ubj
    manifest.json       which files make up the current version, with checksums and metadata

Every file is written to a temporary file in the same directory, flushed to disk and renamed
over its final name (``os.replace``, atomic on POSIX); the manifest goes last. A reader that
goes through the manifest therefore sees either the old version or the new one, whole, and a
crash mid-publication leaves the previous manifest in force. Model files are never rewritten:
a version's files stay until ``keep_versions`` newer versions exist, so a reader that got the
previous manifest can still fetch its files.

A model that was not retrained in a version is carried over: the new manifest points at the
file of the version that trained it (``ModelInfo.version``).

:func:`load_verified_booster` is how a consumer turns (manifest entry, bytes) into a model it
may serve: checksum, XGBoost load and feature columns are all checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import xgboost as xgb
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.features import FEATURE_COLUMNS
from trainer.settings import Objective, TargetTransform
from trainer.training import HoldoutMetrics

ModelName = Literal["ttft", "tpot"]
MODEL_NAMES: tuple[ModelName, ...] = ("ttft", "tpot")
MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_MODEL_FILE = re.compile(r"^(ttft|tpot)-v(\d{6,})\.ubj$")
_TEMP_PREFIX = ".tmp-"


class ArtifactError(Exception):
    """An artifact or manifest is missing, unreadable or fails verification.

    ``reason`` is a short label for metrics: ``manifest``, ``missing``, ``checksum``, ``load``
    or ``columns``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ModelInfo(BaseModel):
    """One model file and what it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ModelName
    version: int = Field(ge=1, description="the version that trained this model")
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    objective: Objective
    quantile: float | None = Field(description="the quantile predicted (quantile objective), else null")
    target_transform: TargetTransform
    feature_columns: tuple[str, ...]
    training_samples: int = Field(ge=0)
    holdout: HoldoutMetrics
    created: datetime


class Manifest(BaseModel):
    """The current version: the model of each name that makes it up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT_VERSION
    version: int = Field(ge=1)
    created: datetime
    models: dict[ModelName, ModelInfo]


@dataclass(frozen=True, slots=True)
class NewModel:
    """A freshly trained model to publish: its bytes and what the manifest says about it."""

    data: bytes
    objective: Objective
    quantile: float | None
    target_transform: TargetTransform
    training_samples: int
    holdout: HoldoutMetrics


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_file_name(name: ModelName, version: int) -> str:
    return f"{name}-v{version:06d}.ubj"


def parse_manifest(data: bytes) -> Manifest:
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise ArtifactError("manifest", f"invalid manifest: {exc.errors(include_url=False)[:3]}") from None


def load_verified_booster(info: ModelInfo, data: bytes) -> xgb.Booster:
    """The booster in ``data``, after checking it against its manifest entry.

    Raises :class:`ArtifactError` if the checksum differs, XGBoost cannot load it, or its
    feature columns are not this code's ``FEATURE_COLUMNS``.
    """
    if len(data) != info.size_bytes or sha256_hex(data) != info.sha256:
        raise ArtifactError("checksum", f"{info.file}: checksum or size does not match the manifest")
    if tuple(info.feature_columns) != FEATURE_COLUMNS:
        raise ArtifactError(
            "columns", f"{info.file}: feature columns {info.feature_columns} differ from ours"
        )
    booster = xgb.Booster()
    try:
        booster.load_model(bytearray(data))
    except xgb.core.XGBoostError as exc:
        raise ArtifactError("load", f"{info.file}: xgboost cannot load it: {str(exc)[:200]}") from None
    if (
        booster.num_features() != len(FEATURE_COLUMNS)
        or tuple(booster.feature_names or ()) != FEATURE_COLUMNS
    ):
        raise ArtifactError("columns", f"{info.file}: the booster's features are not {FEATURE_COLUMNS}")
    return booster


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never a part."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArtifactStore:
    """The trainer's model directory: publishes versions and serves their files.

    Not thread-safe for concurrent publications; the trainer publishes from one thread at a time.
    """

    def __init__(self, directory: Path, keep_versions: int = 3) -> None:
        self.directory = directory
        self.keep_versions = keep_versions
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(_TEMP_PREFIX + "*"):  # from a crash mid-write
            leftover.unlink(missing_ok=True)
        self.current: Manifest | None = self._read_manifest()

    def _read_manifest(self) -> Manifest | None:
        try:
            data = (self.directory / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None
        return parse_manifest(data)

    def publish(self, models: Mapping[ModelName, NewModel]) -> Manifest:
        """Write ``models`` as the next version; models not given are carried over from the
        current version. Returns the new manifest, which is in force once this returns."""
        if not models:
            raise ValueError("nothing to publish")
        version = (self.current.version if self.current else 0) + 1
        now = datetime.now(UTC)
        entries: dict[ModelName, ModelInfo] = dict(self.current.models) if self.current else {}
        for name, model in models.items():
            file = model_file_name(name, version)
            write_atomic(self.directory / file, model.data)
            entries[name] = ModelInfo(
                name=name,
                version=version,
                file=file,
                sha256=sha256_hex(model.data),
                size_bytes=len(model.data),
                objective=model.objective,
                quantile=model.quantile,
                target_transform=model.target_transform,
                feature_columns=FEATURE_COLUMNS,
                training_samples=model.training_samples,
                holdout=model.holdout,
                created=now,
            )
        manifest = Manifest(version=version, created=now, models=entries)
        write_atomic(self.directory / MANIFEST_NAME, manifest.model_dump_json(indent=1).encode())
        self.current = manifest
        self._prune()
        return manifest

    def _prune(self) -> None:
        """Delete files of versions older than the last ``keep_versions`` that nothing references."""
        assert self.current is not None
        oldest_kept = self.current.version - self.keep_versions + 1
        referenced = {info.file for info in self.current.models.values()}
        for _, version, path in self.model_files():
            if version < oldest_kept and path.name not in referenced:
                path.unlink(missing_ok=True)

    def model_files(self) -> list[tuple[ModelName, int, Path]]:
        """(name, version, path) of every model file on disk, oldest first."""
        found = []
        for path in self.directory.iterdir():
            match = _MODEL_FILE.match(path.name)
            if match:
                found.append((match.group(1), int(match.group(2)), path))
        return sorted(found, key=lambda item: (item[1], item[0]))  # type: ignore[return-value]

    def read_model(self, name: ModelName, version: int | None = None) -> tuple[int, bytes]:
        """(version, bytes) of the current ``name`` model, or of the one trained in ``version``."""
        if version is None:
            if self.current is None or name not in self.current.models:
                raise ArtifactError("missing", f"there is no {name} model yet")
            version = self.current.models[name].version
        try:
            return version, (self.directory / model_file_name(name, version)).read_bytes()
        except FileNotFoundError:
            raise ArtifactError("missing", f"no {name} model of version {version} on disk") from None
