"""The direct C-API prediction gives XGBoost's own ``inplace_predict`` results, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import xgboost as xgb

from predictor.dense import DensePredictor


@pytest.fixture(scope="module")
def booster() -> xgb.Booster:
    rng = np.random.default_rng(0)
    features = rng.random((2000, 12), dtype=np.float32)
    target = 3 * features[:, 0] + np.sin(6 * features[:, 1]) + rng.normal(0, 0.1, 2000)
    features[rng.random(features.shape) < 0.05] = np.nan  # missing values take the default branch
    train = xgb.DMatrix(features, label=target)
    booster = xgb.train({"max_depth": 6, "eta": 0.1, "nthread": 1}, train, num_boost_round=50)
    booster.set_param({"nthread": 1})
    return booster


@pytest.mark.parametrize("rows", [1, 7, 100, 1000])
def test_same_as_inplace_predict(booster: xgb.Booster, rows: int) -> None:
    features = np.random.default_rng(rows).random((rows, 12), dtype=np.float32)
    features[::3, 2] = np.nan
    predicted = DensePredictor(booster).predict(features)
    assert predicted.dtype == np.float32
    assert np.array_equal(predicted, booster.inplace_predict(features))


def test_other_layouts_are_converted(booster: xgb.Booster) -> None:
    features = np.random.default_rng(1).random((12, 50)).T  # float64, column-major
    expected = booster.inplace_predict(np.ascontiguousarray(features, dtype=np.float32))
    assert np.array_equal(DensePredictor(booster).predict(features), expected)


def test_no_rows(booster: xgb.Booster) -> None:
    assert DensePredictor(booster).predict(np.empty((0, 12), np.float32)).shape == (0,)


def test_successive_calls_are_independent(booster: xgb.Booster) -> None:
    predictor = DensePredictor(booster)
    rng = np.random.default_rng(2)
    batches = [rng.random((rows, 12), dtype=np.float32) for rows in (10, 1000, 1, 100, 10)]
    predicted = [predictor.predict(features) for features in batches]
    for features, result in zip(batches, predicted, strict=True):
        assert np.array_equal(result, booster.inplace_predict(features))


def test_xgboost_errors_are_raised(booster: xgb.Booster) -> None:
    with pytest.raises(xgb.core.XGBoostError):
        DensePredictor(booster).predict(np.zeros((3, 5), np.float32))
