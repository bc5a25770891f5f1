"""Command-line flags of both servers map one to one onto their settings models."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.settings import PredictorSettings
from trainer.settings import TrainerSettings
from wire.webapp import parse_settings


def test_trainer_defaults_follow_the_anchor_chart_but_for_model_size() -> None:
    """The anchor fits 200 trees of depth 6; ours are 120 of depth 5, which the predictor bench
    measured as accurate (TTFT and TPOT MAPE on later simulated requests, seeds 1-3, two load
    levels) at under half the prediction cost, so that one predictor serves 1,000 calls a second."""
    settings, log_level = parse_settings(TrainerSettings, [], "t", "d")
    assert (settings.port, settings.retrain_interval_s, settings.min_samples) == (8000, 10.0, 40)
    assert (settings.n_estimators, settings.max_depth, settings.learning_rate) == (120, 5, 0.05)
    assert (settings.objective, settings.quantile_alpha, settings.bucket_capacity) == ("mean", 0.9, 500)
    assert log_level == "info"


def test_trainer_flags() -> None:
    argv = ["--model-dir", "/tmp/m", "--objective", "quantile", "--quantile-alpha", "0.95", "--port", "9000"]
    settings, _ = parse_settings(TrainerSettings, argv, "t", "d")
    assert (settings.model_dir, settings.objective, settings.quantile_alpha, settings.port) == (
        Path("/tmp/m"),
        "quantile",
        0.95,
        9000,
    )
    assert settings.training().objective == "quantile"


@pytest.mark.parametrize(
    "argv",
    [["--objective", "median"], ["--quantile-alpha", "1.5"], ["--min-samples", "many"], ["--nope", "1"]],
)
def test_bad_trainer_flags_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(TrainerSettings, argv, "t", "d")


def test_predictor_needs_exactly_one_source() -> None:
    settings, _ = parse_settings(PredictorSettings, ["--trainer-url", "http://127.0.0.1:8000"], "p", "d")
    assert (settings.port, settings.poll_interval_s, settings.model_dir) == (8001, 5.0, None)
    settings, _ = parse_settings(PredictorSettings, ["--model-dir", "/models", "--port", "8002"], "p", "d")
    assert (settings.model_dir, settings.port) == (Path("/models"), 8002)
    for argv in ([], ["--trainer-url", "http://x", "--model-dir", "/models"]):
        with pytest.raises(SystemExit):
            parse_settings(PredictorSettings, argv, "p", "d")
