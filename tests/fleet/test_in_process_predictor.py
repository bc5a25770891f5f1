"""The fleet simulator's in-process predictor answers as the predictor sidecars do."""

from __future__ import annotations

import asyncio

import pytest

from sim.fleet.predictor import InProcessPredictor
from tests.trainer.synthetic import feature_rows, unexplained_tpot


def test_predictions_name_the_targets_a_constant_predicts() -> None:
    predictor = InProcessPredictor()
    try:
        predictor.add_training(unexplained_tpot(300))  # type: ignore[arg-type]
        predictions = asyncio.run(predictor.predict(feature_rows(3)))  # type: ignore[arg-type]
    finally:
        predictor.close()
    assert [p.constant_targets for p in predictions] == [("tpot",)] * 3
    assert [p.tpot_ms for p in predictions] == pytest.approx([20.0] * 3, rel=1e-4)
    assert len({p.ttft_ms for p in predictions}) == 3
