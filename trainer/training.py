"""Fitting one latency model with XGBoost, and judging it on held-out samples.

A model maps a feature matrix (``trainer.features.FEATURE_COLUMNS``) to a latency in
milliseconds. With ``target_transform="log"`` the trees fit log(latency): squared error on the
log scale penalises relative, not absolute, errors, so a 20 ms TTFT and a 20 s one weigh the
same; quantiles are unchanged by the monotone transform, so quantile models fit it too. The
inverse (:func:`latency_from_margin`) is shared by the trainer's evaluation and the predictors.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np
import xgboost as xgb
from pydantic import BaseModel, ConfigDict, Field

from trainer.features import FEATURE_COLUMNS
from trainer.settings import TargetTransform, TrainingSettings
from wire.latency import MAX_LATENCY_MS


class TrainingError(RuntimeError):
    """A model could not be fitted (too few samples, or XGBoost failed)."""


class HoldoutMetrics(BaseModel):
    """Accuracy on the held-out samples (None when nothing was held out or it does not apply).

    ``mape``: mean |predicted − actual| / actual (mean models). ``pinball_loss``: mean quantile
    loss in milliseconds, and ``coverage``: share of actuals at or below the prediction
    (quantile models; a well-calibrated model's coverage is its quantile). ``baseline_loss``:
    the same loss (MAPE or pinball) of a constant prediction, the training latencies' median
    (mean models) or quantile (quantile models). ``folds``: 1 when the samples were one
    held-out share; k > 1 when they were every sample, each predicted by a model fitted on
    the other k − 1 folds (small windows, where a holdout share would be a handful of samples).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples: int = Field(ge=0)
    folds: int = Field(1, ge=1)
    mape: float | None = None
    pinball_loss: float | None = None
    coverage: float | None = None
    baseline_loss: float | None = None

    @property
    def loss(self) -> float | None:
        """The objective's loss: MAPE (mean models) or pinball loss (quantile models)."""
        return self.mape if self.mape is not None else self.pinball_loss

    @property
    def beats_baseline(self) -> bool:
        """Predicts the held-out samples better than the constant does (True when untested)."""
        if self.loss is None or self.baseline_loss is None:
            return True
        return self.loss < self.baseline_loss


@dataclass(frozen=True, slots=True)
class TrainedModel:
    booster: xgb.Booster
    training_samples: int
    holdout: HoldoutMetrics
    duration_s: float


def latency_from_margin(margin: np.ndarray, transform: TargetTransform) -> np.ndarray:
    """Milliseconds from a model's raw output, within [0, MAX_LATENCY_MS]."""
    values = np.exp(margin) if transform == "log" else margin
    return np.clip(values, 0.0, MAX_LATENCY_MS)


TTFT_MONOTONE: Final[Mapping[str, int]] = {
    "input_token_length": 1,
    "effective_input_tokens": 1,
    "prefix_cache_score": -1,
    "num_request_waiting": 1,
    "prefill_tokens_in_flight": 1,
    "is_queued": 1,
}
"""The direction TTFT takes in each feature, all else equal (+1 rises, -1 falls; the others are
free): more tokens to prefill, here or queued ahead, never make a first token come sooner."""


def monotone_constraints(directions: Mapping[str, int]) -> str:
    """XGBoost's ``monotone_constraints`` parameter, in ``FEATURE_COLUMNS`` order."""
    unknown = set(directions) - set(FEATURE_COLUMNS)
    if unknown:
        raise ValueError(f"not feature columns: {sorted(unknown)}")
    return "(" + ",".join(str(directions.get(name, 0)) for name in FEATURE_COLUMNS) + ")"


MIN_HOLDOUT_SAMPLES = 30
"""Below this many held-out samples, the model is judged by cross-validation instead: with a
first fit at 40 samples a 10% holdout is 4 samples, and whether a model beats the constant on 4
samples is a coin toss."""
CV_FOLDS = 5


def train_model(
    features: np.ndarray,
    latencies_ms: np.ndarray,
    settings: TrainingSettings,
    rng: np.random.Generator,
    monotone: Mapping[str, int] | None = None,
) -> TrainedModel:
    """Fit a model to ``latencies_ms`` (all > 0), holding out ``settings.holdout_fraction``; where
    that share is under ``MIN_HOLDOUT_SAMPLES`` samples, judge it by ``CV_FOLDS``-fold
    cross-validation and fit the served model on every sample. ``monotone`` gives the direction
    the prediction must take in some features (as ``TTFT_MONOTONE``)."""
    n = len(features)
    if n < 2 or len(latencies_ms) != n:
        raise TrainingError(f"need at least 2 samples with one latency each, got {n}")
    if not np.all(latencies_ms > 0):
        raise TrainingError("latencies must be positive")
    started = time.perf_counter()
    n_holdout = round(n * settings.holdout_fraction)
    if settings.holdout_fraction > 0 and n >= 10:
        n_holdout = max(n_holdout, 1)
    order = rng.permutation(n)
    if 0 < n_holdout < MIN_HOLDOUT_SAMPLES:
        holdout = _cross_validate(features, latencies_ms, settings, order, monotone)
        booster = _fit(features, latencies_ms, settings, monotone)
        return TrainedModel(booster, n, holdout, time.perf_counter() - started)
    held, kept = order[:n_holdout], order[n_holdout:]
    booster = _fit(features[kept], latencies_ms[kept], settings, monotone)
    holdout = evaluate(booster, features[held], latencies_ms[held], settings, latencies_ms[kept])
    return TrainedModel(booster, len(kept), holdout, time.perf_counter() - started)


def _cross_validate(
    features: np.ndarray,
    latencies_ms: np.ndarray,
    settings: TrainingSettings,
    order: np.ndarray,
    monotone: Mapping[str, int] | None,
) -> HoldoutMetrics:
    """Out-of-fold metrics: each fold predicted by a model fitted on the others, and judged
    against the constant of those others."""
    predicted = np.empty(len(features))
    baseline = np.empty(len(features))
    level = settings.quantile_alpha if settings.objective == "quantile" else 0.5
    for held in np.array_split(order, CV_FOLDS):
        kept = np.setdiff1d(order, held, assume_unique=True)
        booster = _fit(features[kept], latencies_ms[kept], settings, monotone)
        predicted[held] = latency_from_margin(
            booster.inplace_predict(features[held]), settings.target_transform
        )
        baseline[held] = np.quantile(latencies_ms[kept], level)
    return _metrics(predicted, latencies_ms, baseline, settings, folds=CV_FOLDS)


def _fit(
    features: np.ndarray,
    latencies_ms: np.ndarray,
    settings: TrainingSettings,
    monotone: Mapping[str, int] | None,
) -> xgb.Booster:
    target = np.log(latencies_ms) if settings.target_transform == "log" else latencies_ms
    params: dict[str, object] = {
        "tree_method": "hist",
        "max_depth": settings.max_depth,
        "eta": settings.learning_rate,
        "seed": settings.seed,
        "objective": "reg:squarederror" if settings.objective == "mean" else "reg:quantileerror",
    }
    if settings.objective == "quantile":
        params["quantile_alpha"] = settings.quantile_alpha
    if settings.train_threads:
        params["nthread"] = settings.train_threads
    if monotone:
        params["monotone_constraints"] = monotone_constraints(monotone)
    try:
        train = xgb.DMatrix(features, label=target, feature_names=list(FEATURE_COLUMNS))
        return xgb.train(params, train, num_boost_round=settings.n_estimators)
    except xgb.core.XGBoostError as exc:
        raise TrainingError(f"xgboost failed: {exc}") from exc


def constant_model(
    latencies_ms: np.ndarray, settings: TrainingSettings, holdout: HoldoutMetrics
) -> TrainedModel:
    """A model without trees that predicts the constant a fitted model is judged against (the
    latencies' median, or quantile for quantile models), with ``holdout`` (the fitted model's
    judgement) restated as that constant's: its loss is the baseline's."""
    level = settings.quantile_alpha if settings.objective == "quantile" else 0.5
    value = max(float(np.quantile(latencies_ms, level)), 1e-6)
    params: dict[str, object] = {
        "objective": "reg:squarederror" if settings.objective == "mean" else "reg:quantileerror",
        "base_score": float(np.log(value)) if settings.target_transform == "log" else value,
    }
    if settings.objective == "quantile":
        params["quantile_alpha"] = settings.quantile_alpha
    labels = np.full(len(latencies_ms), params["base_score"])
    train = xgb.DMatrix(
        np.zeros((len(latencies_ms), len(FEATURE_COLUMNS)), np.float32),
        label=labels,
        feature_names=list(FEATURE_COLUMNS),
    )
    booster = xgb.train(params, train, num_boost_round=0)
    loss = (
        {"mape": holdout.baseline_loss}
        if settings.objective == "mean"
        else {"pinball_loss": holdout.baseline_loss}
    )
    restated = holdout.model_copy(update={**loss, "coverage": None})
    return TrainedModel(booster, len(latencies_ms), restated, 0.0)


def evaluate(
    booster: xgb.Booster,
    features: np.ndarray,
    latencies_ms: np.ndarray,
    settings: TrainingSettings,
    training_latencies_ms: np.ndarray | None = None,
) -> HoldoutMetrics:
    """The metrics that apply to ``settings.objective`` on these samples; given the training
    latencies, also ``baseline_loss``: the loss of predicting their median (or quantile)."""
    n = len(features)
    if n == 0:
        return HoldoutMetrics(samples=0)
    predicted = latency_from_margin(booster.inplace_predict(features), settings.target_transform)
    constant = None
    if training_latencies_ms is not None and len(training_latencies_ms):
        level = settings.quantile_alpha if settings.objective == "quantile" else 0.5
        constant = np.full(n, np.quantile(training_latencies_ms, level))
    return _metrics(predicted, latencies_ms, constant, settings, folds=1)


def _metrics(
    predicted: np.ndarray,
    latencies_ms: np.ndarray,
    constant: np.ndarray | None,
    settings: TrainingSettings,
    folds: int,
) -> HoldoutMetrics:
    n = len(latencies_ms)
    baseline = None if constant is None else _loss(constant, latencies_ms, settings)
    loss = _loss(predicted, latencies_ms, settings)
    if settings.objective == "mean":
        return HoldoutMetrics(samples=n, folds=folds, mape=loss, baseline_loss=baseline)
    coverage = float(np.mean(latencies_ms <= predicted))
    return HoldoutMetrics(
        samples=n, folds=folds, pinball_loss=loss, coverage=coverage, baseline_loss=baseline
    )


def _loss(predicted: np.ndarray, latencies_ms: np.ndarray, settings: TrainingSettings) -> float:
    """MAPE (mean objective) or mean pinball loss in ms (quantile objective)."""
    if settings.objective == "mean":
        return float(np.mean(np.abs(predicted - latencies_ms) / latencies_ms))
    alpha = settings.quantile_alpha
    error = latencies_ms - predicted
    return float(np.mean(np.maximum(alpha * error, (alpha - 1.0) * error)))
