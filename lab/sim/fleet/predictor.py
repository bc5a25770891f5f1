"""The latency predictor in process: the real trainer service and model loading, on virtual time.

``InProcessPredictor`` implements ``epp.scheduling.predictor.LatencyPredictor`` for the fleet
simulator. Training samples go through ``TrainerService.add_samples`` (validation, the two
stratified windows); ``retrain`` runs the trainer's retraining and publication into a private
model directory and loads the published version exactly as a predictor sidecar does
(``predictor.models.build_model_set``: checksums, XGBoost load, feature columns). The simulator
calls ``retrain`` every so many virtual seconds; the first model, and the first after a retrain
request (the EPP's predictions drifted), is fitted as soon as the trainer says a fit is due
(``TrainerService.fit_due``), as the live trainer does, and
served at once: the live fit, download and load take about a second that is not modelled here.
Until a TTFT model exists, ``predict`` answers ``warming_up`` like the sidecars, and the EPP's
plugins fall back to their heuristics.

One deliberate difference from the live trainer, for speed: a retraining is skipped unless the
TTFT window received at least ``min_growth`` (25%) of its size in new samples since the last fit.
The live trainer refits on any change every 10 s; an XGBoost fit costs ~0.3–0.6 s of CPU, which a
one-hour trace replayed in a minute cannot pay 360 times. Early on (small windows) this refits
often, later after every 25% of new traffic.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from epp.scheduling.predictor import Prediction, PredictionUnavailable
from predictor.models import ModelSet, build_model_set
from trainer.features import decode_feature_rows
from trainer.service import TrainerService
from trainer.settings import TrainerSettings
from wire.latency import FeatureRowDict, TrainingSampleDict


class InProcessPredictor:
    def __init__(
        self, settings: TrainerSettings | None = None, *, seed: int = 0, min_growth: float = 0.25
    ) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="llm-epp-fleet-models-")
        base = settings or TrainerSettings(train_threads=1)
        self.settings = base.model_copy(update={"model_dir": Path(self._directory.name), "seed": seed})
        self.service = TrainerService(self.settings)
        self.models: ModelSet | None = None
        self.retrains = 0
        self.min_growth = min_growth
        self._fitted_at = 0

    async def predict(self, rows: Sequence[FeatureRowDict]) -> list[Prediction]:
        models = self.models
        if models is None:
            raise PredictionUnavailable("warming_up")
        ttft, tpot = models.predict(decode_feature_rows(rows))
        version, constant = models.version, models.constant_targets
        return [
            Prediction(a, b, version, constant) for a, b in zip(ttft.tolist(), tpot.tolist(), strict=True)
        ]

    def add_training(self, samples: Sequence[TrainingSampleDict]) -> None:
        self.service.add_samples(samples)
        if self.service.fit_due:
            self.retrain()

    def request_retrain(self) -> None:
        """The EPP saw the predictions drift: the trainer forgets its samples
        (``TrainerService.request_retrain``) and the model is refitted as soon as enough new ones
        arrived."""
        self.service.request_retrain()
        self._fitted_at = 0

    def retrain(self) -> bool:
        """Fit the models that have new samples and serve the new version; False if none was due."""
        window = self.service.windows["ttft"]
        if window.added_total - self._fitted_at < self.min_growth * len(window):
            return False
        self._fitted_at = window.added_total
        manifest = asyncio.run(self.service.retrain())
        if manifest is None:
            return False
        directory = self.settings.model_dir
        blobs = {name: (directory / info.file).read_bytes() for name, info in manifest.models.items()}
        self.models = build_model_set(
            manifest, blobs, loaded_at=datetime.now(UTC), source=str(directory), threads=1
        )
        self.retrains += 1
        return True

    def close(self) -> None:
        self._directory.cleanup()
