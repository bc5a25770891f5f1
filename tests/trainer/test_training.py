"""Retraining on data with a known latency function."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.trainer.synthetic import training_samples, uncached_sweep
from trainer.features import FEATURE_COLUMNS, TRAINING_SAMPLE_DECODER, matrix_from_columns
from trainer.settings import TrainingSettings
from trainer.training import (
    TTFT_MONOTONE,
    TrainingError,
    constant_model,
    evaluate,
    latency_from_margin,
    monotone_constraints,
    train_model,
)
from wire.latency import endpoint_class_code


def dataset(n: int, seed: int = 0, noise: float = 0.02) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    columns = TRAINING_SAMPLE_DECODER.decode(training_samples(n, seed, noise))
    return matrix_from_columns(columns), columns["actual_ttft_ms"], columns["actual_tpot_ms"]


@pytest.mark.parametrize("transform", ["log", "raw"])
def test_mean_models_learn_a_clean_latency_function(transform: str) -> None:
    features, ttft, tpot = dataset(4000)
    settings = TrainingSettings(target_transform=transform)
    for latencies in (ttft, tpot):
        model = train_model(features, latencies, settings, np.random.default_rng(0))
        assert model.holdout.samples == 400
        assert model.training_samples == 3600
        assert model.holdout.mape is not None and model.holdout.mape < 0.04
        assert model.holdout.pinball_loss is None and model.holdout.coverage is None
        assert model.booster.feature_names is not None


def test_quantile_models_report_pinball_loss_and_coverage() -> None:
    features, ttft, _ = dataset(4000, noise=0.2)
    settings = TrainingSettings(objective="quantile", quantile_alpha=0.9)
    model = train_model(features, ttft, settings, np.random.default_rng(0))
    assert model.holdout.mape is None
    assert model.holdout.pinball_loss is not None and model.holdout.pinball_loss > 0
    assert model.holdout.coverage is not None and 0.75 <= model.holdout.coverage <= 0.99


def test_a_model_generalises_to_unseen_samples() -> None:
    features, ttft, _ = dataset(4000, seed=1)
    model = train_model(features, ttft, TrainingSettings(), np.random.default_rng(0))
    fresh_features, fresh_ttft, _ = dataset(1000, seed=99)
    assert evaluate(model.booster, fresh_features, fresh_ttft, TrainingSettings()).mape < 0.04


def _depth(node: dict[str, Any]) -> int:
    return 1 + max((_depth(child) for child in node.get("children", ())), default=-1)


def test_a_model_has_the_trees_and_depth_of_its_settings() -> None:
    """What a predictor's CPU time per call grows with (the defaults are pinned in test_settings)."""
    features, ttft, _ = dataset(2000)
    settings = TrainingSettings(n_estimators=30, max_depth=3)
    model = train_model(features, ttft, settings, np.random.default_rng(0))
    trees = [json.loads(tree) for tree in model.booster.get_dump(dump_format="json")]
    assert len(trees) == 30
    assert max(map(_depth, trees)) == 3


def stalls(n: int, seed: int) -> np.ndarray:
    """Latencies unrelated to the features: 100 ms, but one in ten a random 1-10 s stall."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < 0.1, rng.uniform(1000, 10_000, n), 100.0)


def test_a_model_that_learned_the_latency_beats_the_constant_baseline() -> None:
    features, ttft, _ = dataset(300)
    holdout = train_model(features, ttft, TrainingSettings(), np.random.default_rng(0)).holdout
    # the training median is 3 to 10 times further off than the model
    assert holdout.baseline_loss is not None and holdout.mape is not None
    assert holdout.mape * 3 < holdout.baseline_loss
    assert holdout.beats_baseline


@pytest.mark.parametrize("seed", [1, 2])
def test_a_model_chasing_unexplained_stalls_loses_to_the_constant(seed: int) -> None:
    features, _, _ = dataset(300, seed=seed)
    model = train_model(features, stalls(300, seed), TrainingSettings(), np.random.default_rng(seed))
    holdout = model.holdout
    assert holdout.loss == holdout.mape
    assert not holdout.beats_baseline  # predicting 100 ms always is nearer the truth


@pytest.mark.parametrize(
    ("objective", "transform", "level"),
    [("mean", "log", 0.5), ("mean", "raw", 0.5), ("quantile", "log", 0.9)],
)
def test_the_constant_model_predicts_the_baseline_it_was_judged_by(
    objective: str, transform: str, level: float
) -> None:
    features, _, _ = dataset(300, seed=1)
    latencies = stalls(300, 1)
    settings = TrainingSettings(objective=objective, target_transform=transform, quantile_alpha=0.9)
    fitted = train_model(features, latencies, settings, np.random.default_rng(1))
    model = constant_model(latencies, settings, fitted.holdout)
    predicted = latency_from_margin(model.booster.inplace_predict(features[:5]), transform)
    assert predicted == pytest.approx(np.full(5, np.quantile(latencies, level)), rel=1e-5)
    assert model.booster.num_boosted_rounds() == 0 and model.training_samples == 300
    assert model.holdout.loss == fitted.holdout.baseline_loss and model.holdout.coverage is None


def test_a_small_window_is_judged_by_cross_validation_on_every_sample() -> None:
    features, ttft, _ = dataset(60)
    model = train_model(features, ttft, TrainingSettings(), np.random.default_rng(0))
    assert model.holdout.folds == 5 and model.holdout.samples == 60
    assert model.training_samples == 60  # the served model is fitted on all of them
    assert model.holdout.mape is not None and model.holdout.baseline_loss is not None
    assert model.holdout.mape * 2 < model.holdout.baseline_loss


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cross_validation_withholds_a_small_model_chasing_stalls(seed: int) -> None:
    features, _, _ = dataset(50, seed=seed)
    model = train_model(features, stalls(50, seed), TrainingSettings(), np.random.default_rng(seed))
    assert model.holdout.folds == 5 and not model.holdout.beats_baseline


def test_a_large_window_keeps_one_holdout_share() -> None:
    features, ttft, _ = dataset(400)
    model = train_model(features, ttft, TrainingSettings(), np.random.default_rng(0))
    assert model.holdout.folds == 1 and model.holdout.samples == 40 and model.training_samples == 360


def test_nothing_held_out_means_no_metrics() -> None:
    features, ttft, _ = dataset(200)
    model = train_model(features, ttft, TrainingSettings(holdout_fraction=0.0), np.random.default_rng(0))
    assert model.holdout.samples == 0
    assert model.holdout.mape is None and model.holdout.baseline_loss is None
    assert model.holdout.beats_baseline  # untested models are not withheld


def test_latency_from_margin_clips_and_inverts() -> None:
    assert latency_from_margin(np.log(np.array([5.0, 50.0])), "log").tolist() == pytest.approx([5.0, 50.0])
    assert latency_from_margin(np.array([-3.0, 7.0]), "raw").tolist() == [0.0, 7.0]
    assert latency_from_margin(np.array([1e9]), "raw").tolist() == [3_600_000.0]


def test_unusable_data_is_refused() -> None:
    features, ttft, _ = dataset(20)
    with pytest.raises(TrainingError):
        train_model(features[:1], ttft[:1], TrainingSettings(), np.random.default_rng(0))
    with pytest.raises(TrainingError):
        train_model(features, np.zeros(20), TrainingSettings(), np.random.default_rng(0))


@pytest.mark.parametrize("monotone", [TTFT_MONOTONE, None])
def test_a_monotone_ttft_model_never_predicts_more_uncached_tokens_as_faster(monotone) -> None:
    # Noisy, small: the window a model is first fitted on, where trees wander most.
    features, ttft, _ = dataset(300, seed=3, noise=0.5)
    model = train_model(features, ttft, TrainingSettings(), np.random.default_rng(0), monotone)
    steps = np.diff(model.booster.inplace_predict(uncached_sweep(features)))
    if monotone:
        assert np.all(steps >= 0)
    else:
        assert np.any(steps < 0)  # what the constraint prevents


def test_monotone_constraints_follow_the_feature_columns() -> None:
    text = monotone_constraints({"prefix_cache_score": -1, "is_queued": 1})
    directions = [int(x) for x in text.strip("()").split(",")]
    assert len(directions) == len(FEATURE_COLUMNS)
    assert directions[FEATURE_COLUMNS.index("prefix_cache_score")] == -1
    assert directions[FEATURE_COLUMNS.index("is_queued")] == 1
    assert sum(map(abs, directions)) == 2
    with pytest.raises(ValueError, match="not feature columns"):
        monotone_constraints({"prompt_colour": 1})


def test_a_model_learns_each_endpoint_class_speed_from_its_samples() -> None:
    """Two classes at the same loads, one 2.5x slower: the model predicts each class its own
    latency, where without the class it could only predict their mix."""
    samples = training_samples(4000)
    slow = endpoint_class_code("slow-accelerator")
    for i, sample in enumerate(samples):
        if i % 4 == 0:  # a quarter of the pool is slow
            sample.update(
                endpoint_class=slow,
                actual_ttft_ms=2.5 * sample["actual_ttft_ms"],
                actual_tpot_ms=2.5 * sample["actual_tpot_ms"],
            )
    columns = TRAINING_SAMPLE_DECODER.decode(samples)
    features = matrix_from_columns(columns)
    settings = TrainingSettings()
    model = train_model(features, columns["actual_ttft_ms"], settings, np.random.default_rng(0))
    fresh = training_samples(500, seed=5)
    fast_features = matrix_from_columns(TRAINING_SAMPLE_DECODER.decode(fresh))
    slow_features = fast_features.copy()
    slow_features[:, FEATURE_COLUMNS.index("endpoint_class")] = slow
    fast = latency_from_margin(model.booster.inplace_predict(fast_features), settings.target_transform)
    slowed = latency_from_margin(model.booster.inplace_predict(slow_features), settings.target_transform)
    assert 2.2 < float(np.median(slowed / fast)) < 2.8
