"""The latency predictor as the scheduling core sees it: what a predictor answers for a feature
row, and the interface the live EPP's HTTP client and the fleet simulator's in-process model
both implement (``PluginContext.latency_predictor``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from wire.latency import FeatureRowDict, TrainingSampleDict


class PredictionUnavailable(Exception):
    """No prediction within the time box; ``reason`` names why (a metric label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    model_version: int | None = None
    """The model version that predicted it, where the predictor says."""
    constant_targets: tuple[str, ...] = ()
    """The targets (``ttft``, ``tpot``) that version predicts by a constant (a model without
    trees, which the trainer serves where its fitted model did not beat the median)."""


class LatencyPredictor(Protocol):
    """Predicts latency for feature rows (``trainer.features`` field names) and takes training samples.

    The live EPP's implementation calls predictor sidecars over HTTP; the fleet simulator's runs
    the model in process. ``predict`` raises :class:`PredictionUnavailable` when it cannot answer.
    """

    async def predict(self, rows: Sequence[FeatureRowDict]) -> list[Prediction]: ...

    def add_training(self, samples: Sequence[TrainingSampleDict]) -> None: ...

    def request_retrain(self) -> None:
        """Ask for a model trained on the newest samples soon (the live error drifted)."""
        ...
