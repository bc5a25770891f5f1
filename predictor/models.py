"""The models a predictor serves: one verified booster per latency, grouped by version.

A :class:`ModelSet` is what a version's manifest describes, loaded and verified; it is
immutable, so swapping the one a server holds swaps both models at once. It can also be used
in process (the fleet simulator) without any server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from predictor.dense import DensePredictor
from trainer.artifacts import ArtifactError, Manifest, ModelInfo, ModelName, load_verified_booster
from trainer.training import latency_from_margin


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """One loaded latency model (TTFT or TPOT) of a version: its manifest entry and its trees.
    ``constant``: it has no trees (``trainer.training.constant_model``, served where a fitted
    model did not beat the constant), so it predicts the same latency for every row."""

    info: ModelInfo
    predictor: DensePredictor
    constant: bool

    def predict_ms(self, features: np.ndarray) -> np.ndarray:
        """Latency in milliseconds for each row of a ``FEATURE_COLUMNS`` matrix (float32)."""
        return latency_from_margin(self.predictor.predict(features), self.info.target_transform)


@dataclass(frozen=True, slots=True)
class ModelSet:
    """The models of one version. ``tpot`` is None until the trainer has had TPOT samples
    (non-streaming traffic has none); TPOT predictions are then 0."""

    version: int
    ttft: LatencyModel
    tpot: LatencyModel | None
    loaded_at: datetime
    source: str

    @property
    def constant_targets(self) -> tuple[ModelName, ...]:
        """The targets whose model is a constant (no trees): their predictions do not depend on
        the row, so their error says nothing about how well the model ranks endpoints."""
        return tuple(m.info.name for m in (self.ttft, self.tpot) if m is not None and m.constant)

    @property
    def quantile(self) -> float | None:
        """The quantile the models predict (quantile objective), None for mean models."""
        return self.ttft.info.quantile

    def predict(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(TTFT ms, TPOT ms) for each row of a ``FEATURE_COLUMNS`` matrix."""
        ttft = self.ttft.predict_ms(features)
        tpot = self.tpot.predict_ms(features) if self.tpot else np.zeros(len(features))
        return ttft, tpot


def build_model_set(
    manifest: Manifest,
    blobs: Mapping[ModelName, bytes],
    *,
    loaded_at: datetime,
    source: str,
    threads: int = 1,
) -> ModelSet:
    """Verify and load every model ``manifest`` lists from ``blobs`` (its bytes, by name).

    Raises :class:`ArtifactError` if the manifest has no TTFT model or any model fails
    verification; nothing of a version that fails is ever served.
    """
    served: dict[ModelName, LatencyModel] = {}
    for name, info in manifest.models.items():
        if name not in blobs:
            raise ArtifactError("missing", f"no bytes for the {name} model of version {manifest.version}")
        booster = load_verified_booster(info, blobs[name])
        booster.set_param({"nthread": threads})
        served[name] = LatencyModel(info, DensePredictor(booster), booster.num_boosted_rounds() == 0)
    if "ttft" not in served:
        raise ArtifactError("missing", f"version {manifest.version} has no TTFT model")
    return ModelSet(manifest.version, served["ttft"], served.get("tpot"), loaded_at, source)
