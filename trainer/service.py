"""The training server's work, apart from HTTP: sample intake into the two windows, periodic
retraining in a worker thread, and publication of each new version.

Intake is all or nothing: a bulk with any invalid sample is refused whole (as the llm-d
training server's bulk endpoint does), every sample in it is counted as rejected, and none
reaches a window, so a poisoned sample is never trained on.

A sample goes to the TTFT window when its ``actual_ttft_ms`` is > 0 and to the TPOT window when
its ``actual_tpot_ms`` is > 0 (the EPP sends one row of each kind per request). A model is
retrained when its window holds ``min_samples`` and changed since its last fit. A fresh model
that predicts its held-out samples no better than a constant (the training median) is withheld.
A withheld TTFT model leaves the previous one, or the EPP's heuristic fallback: routing on it
would be noise, and a constant TTFT cannot tell endpoints apart either. A withheld TPOT model is
replaced by that constant (``training.constant_model``), the better predictor by the trainer's
own test: decoding speed that barely varies (a lightly loaded pool) is predicted by its median,
where no TPOT model would mean a predicted TPOT of 0 (every TPOT SLO met, TPOT error 100%). A
version is published only when it has a TTFT model (fresh or carried over); the TPOT model is
optional, since non-streaming traffic never trains one.

Schedule: the first version is fitted as soon as the TTFT window holds ``min_samples`` (the
EPP routes on its heuristic fallback until then, so every second of waiting counts); after
that, every ``retrain_interval_s``.

A retrain request (:meth:`TrainerService.request_retrain`: the EPP's live predictions drifted,
so the engines no longer behave as the windows remember) empties both windows and fits again as
soon as they hold ``min_samples`` new samples (the TPOT window too, where the current version
has a TPOT model): a model fitted on the old samples and a few new ones would stay as wrong.
The current version is served until then (the EPP routes on its heuristics meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.artifacts import MODEL_NAMES, ArtifactStore, Manifest, ModelName, NewModel
from trainer.features import FEATURE_COLUMNS, TRAINING_SAMPLE_DECODER, RowError, matrix_from_columns
from trainer.metrics import TrainerMetrics, rejection_reason
from trainer.settings import TrainerSettings
from trainer.training import TTFT_MONOTONE, constant_model, train_model
from trainer.window import StratifiedWindow

log = logging.getLogger(__name__)

_LATENCY_COLUMN: dict[ModelName, str] = {"ttft": "actual_ttft_ms", "tpot": "actual_tpot_ms"}


class SamplesRejected(Exception):
    """A bulk of samples was refused whole; ``errors`` name each bad entry, by index."""

    def __init__(self, errors: list[RowError], total: int) -> None:
        super().__init__(f"{len(errors)} of {total} samples are invalid; none was accepted")
        self.errors = errors


@dataclass(frozen=True, slots=True)
class _Job:
    features: np.ndarray
    latencies_ms: np.ndarray
    window_mark: int


class TrainerService:
    def __init__(self, settings: TrainerSettings, metrics: TrainerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or TrainerMetrics()
        self.store = ArtifactStore(settings.model_dir, settings.keep_versions)
        self.windows = {
            name: StratifiedWindow(len(FEATURE_COLUMNS), settings.bucket_capacity) for name in MODEL_NAMES
        }
        self._fitted_mark: dict[ModelName, int] = dict.fromkeys(MODEL_NAMES, -1)
        self._retrain_lock = asyncio.Lock()
        self._first_fit = asyncio.Event()
        self._refit = False
        """The windows were emptied on request: fit as soon as they refill."""
        self._rng = np.random.default_rng(settings.seed)
        if self.store.current is not None:
            self._report(self.store.current)

    def add_samples(self, entries: Sequence[Any]) -> int:
        """Validate parsed JSON samples and add them to the windows; returns how many.

        Raises :class:`SamplesRejected` (nothing added) if any entry is invalid.
        """
        columns, errors = TRAINING_SAMPLE_DECODER.decode_valid(entries)
        if errors:
            for error in errors.values():
                self.metrics.rejected_samples.labels(rejection_reason(error.error_type)).inc()
            if len(entries) > len(errors):
                self.metrics.rejected_samples.labels("batch_rejected").inc(len(entries) - len(errors))
            raise SamplesRejected([errors[i] for i in sorted(errors)], len(entries))
        features = matrix_from_columns(columns)
        used = np.zeros(len(entries), dtype=bool)
        for name, window in self.windows.items():
            latencies = columns[_LATENCY_COLUMN[name]]
            measured = latencies > 0
            window.add(features[measured], latencies[measured])
            used |= measured
            self.metrics.samples.labels(name).inc(int(measured.sum()))
            self.metrics.window_samples.labels(name).set(len(window))
        self.metrics.samples.labels("unused").inc(int((~used).sum()))
        if self.fit_due:
            self._first_fit.set()
        return len(entries)

    @property
    def first_fit_due(self) -> bool:
        """No version exists yet and the TTFT window holds enough samples for the first."""
        return self.store.current is None and len(self.windows["ttft"]) >= self.settings.min_samples

    @property
    def fit_due(self) -> bool:
        """A fit is due now rather than at the next interval: the first one, or the one after a
        retrain request once the emptied windows hold enough new samples."""
        if self.first_fit_due:
            return True
        if not self._refit or len(self.windows["ttft"]) < self.settings.min_samples:
            return False
        current = self.store.current
        has_tpot = current is not None and "tpot" in current.models
        return not has_tpot or len(self.windows["tpot"]) >= self.settings.min_samples

    def request_retrain(self) -> None:
        """Forget the samples held and fit again as soon as enough new ones arrived."""
        self.metrics.retrain_requests.inc()
        for name in MODEL_NAMES:
            self.windows[name] = StratifiedWindow(len(FEATURE_COLUMNS), self.settings.bucket_capacity)
            self._fitted_mark[name] = -1
            self.metrics.window_samples.labels(name).set(0)
        self._refit = True
        log.info(
            "retrain requested: windows emptied, the next fit waits for %d new samples",
            self.settings.min_samples,
        )

    def data_status(self) -> dict[str, Any]:
        return {
            "min_samples": self.settings.min_samples,
            "models": {name: window.status() for name, window in self.windows.items()},
        }

    async def run_forever(self) -> None:
        """Retrain every ``retrain_interval_s``, and at once when the first fit is due, until
        cancelled; failures are logged and counted. A first fit that failed or was withheld is
        retried when more samples arrive."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.retrain_interval_s):
                    await self._first_fit.wait()
            woken = self._first_fit.is_set()
            self._first_fit.clear()
            if woken and not self.fit_due:
                continue  # set by samples that came in during a first fit, which has since published
            try:
                await self.retrain()
            except Exception:
                log.exception("retraining failed")
                self.metrics.retrain_failures.inc()

    async def retrain(self) -> Manifest | None:
        """Fit every model that is due and publish a version; None if nothing was due or no
        version could be published (no TTFT model beat its baseline yet).

        The fitting runs in a worker thread (XGBoost releases the GIL), so the event loop keeps
        taking samples meanwhile; the windows are copied first.
        """
        async with self._retrain_lock:
            jobs = self._due_jobs()
            if not jobs:
                return None
            manifest = await asyncio.to_thread(self._fit_and_publish, jobs)
            for name, job in jobs.items():
                self._fitted_mark[name] = job.window_mark
            if manifest is None:
                return None
            self._refit = False
            self._report(manifest)
            log.info(
                "published version %d (%s)",
                manifest.version,
                ", ".join(f"{n}: {info.training_samples} samples" for n, info in manifest.models.items()),
            )
            return manifest

    def _due_jobs(self) -> dict[ModelName, _Job]:
        jobs: dict[ModelName, _Job] = {}
        for name, window in self.windows.items():
            if len(window) >= self.settings.min_samples and window.added_total != self._fitted_mark[name]:
                features, latencies = window.snapshot()
                jobs[name] = _Job(features, latencies, window.added_total)
        current = self.store.current
        has_ttft = "ttft" in jobs or (current is not None and "ttft" in current.models)
        return jobs if has_ttft else {}

    def _fit_and_publish(self, jobs: dict[ModelName, _Job]) -> Manifest | None:
        training = self.settings.training()
        quantile = training.quantile_alpha if training.objective == "quantile" else None
        models: dict[ModelName, NewModel] = {}
        for name, job in jobs.items():
            monotone = TTFT_MONOTONE if name == "ttft" and training.ttft_monotone else None
            fitted = train_model(job.features, job.latencies_ms, training, self._rng, monotone)
            self.metrics.retrain_duration.labels(name).observe(fitted.duration_s)
            if not fitted.holdout.beats_baseline:
                self.metrics.withheld_models.labels(name).inc()
                log.info(
                    "withheld the %s model fitted on %d samples: holdout loss %.4g, a constant's %.4g%s",
                    name,
                    fitted.training_samples,
                    fitted.holdout.loss,
                    fitted.holdout.baseline_loss,
                    "; serving the constant" if name == "tpot" else "",
                )
                if name != "tpot":
                    continue
                fitted = constant_model(job.latencies_ms, training, fitted.holdout)
            models[name] = NewModel(
                data=bytes(fitted.booster.save_raw("ubj")),
                objective=training.objective,
                quantile=quantile,
                target_transform=training.target_transform,
                training_samples=fitted.training_samples,
                holdout=fitted.holdout,
            )
        current = self.store.current
        if "ttft" not in models and (current is None or "ttft" not in current.models):
            return None
        return self.store.publish(models) if models else None

    def _report(self, manifest: Manifest) -> None:
        m = self.metrics
        m.model_version.set(manifest.version)
        for name, info in manifest.models.items():
            m.training_samples.labels(name).set(info.training_samples)
            m.version_holdout_error(name, info.version, info.holdout.loss, self.settings.keep_versions)
            for gauge, value in (
                (m.mape, info.holdout.mape),
                (m.pinball_loss, info.holdout.pinball_loss),
                (m.coverage, info.holdout.coverage),
            ):
                if value is None:
                    gauge.remove(name)  # does not apply to this objective (or nothing was held out)
                else:
                    gauge.labels(name).set(value)
