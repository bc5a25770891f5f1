"""Synthetic training data with a known latency function, and a trained model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.artifacts import Manifest
from trainer.features import FEATURE_COLUMNS
from trainer.service import TrainerService
from trainer.settings import TrainerSettings

ROW_FIELDS = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
    "pod_type",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "endpoint_class",
)


def true_ttft_ms(row: dict[str, Any]) -> float:
    uncached = row["input_token_length"] * (1.0 - row["prefix_cache_score"])
    return (
        15.0
        + 0.04 * uncached
        + 25.0 * row["num_request_waiting"]
        + 0.002 * row["prefill_tokens_in_flight"]
        + 8.0 * row["kv_cache_percentage"]
    )


def true_tpot_ms(row: dict[str, Any]) -> float:
    return 6.0 + 0.25 * row["num_request_running"] + 30.0 * row["kv_cache_percentage"]


def feature_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` valid feature rows (JSON types) spread over every window bucket."""
    rng = np.random.default_rng(seed)
    return [
        {
            "kv_cache_percentage": float(rng.random()),
            "input_token_length": int(rng.integers(1, 4000)),
            "num_request_waiting": int(rng.integers(0, 16)),
            "num_request_running": int(rng.integers(0, 64)),
            "num_tokens_generated": 0,
            "prefix_cache_score": float(rng.random()),
            "pod_type": "",
            "prefill_tokens_in_flight": int(rng.integers(0, 20_000)),
            "decode_tokens_in_flight": int(rng.integers(0, 50_000)),
            "endpoint_class": 0,
        }
        for _ in range(n)
    ]


def training_samples(n: int, seed: int = 0, noise: float = 0.02) -> list[dict[str, Any]]:
    """``n`` samples whose latencies follow the known functions, within ±``noise`` (relative)."""
    rng = np.random.default_rng(seed + 1)
    samples = []
    for row in feature_rows(n, seed):
        ttft, tpot = true_ttft_ms(row), true_tpot_ms(row)
        samples.append(
            {
                **row,
                "actual_ttft_ms": ttft * float(rng.uniform(1 - noise, 1 + noise)),
                "actual_tpot_ms": tpot * float(rng.uniform(1 - noise, 1 + noise)),
                "timestamp": 1_700_000_000.0,
            }
        )
    return samples


def unexplained_tpot(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` samples whose TPOT no feature explains (a light load): 20 ms, with one in ten a
    stall of 0.2-2 s; a fitted TPOT model does not beat the median, so the trainer serves it."""
    samples = training_samples(n, seed)
    rng = np.random.default_rng(seed)
    for sample in samples:
        sample["actual_tpot_ms"] = float(rng.uniform(200, 2000)) if rng.random() < 0.1 else 20.0
    return samples


async def publish_version(model_dir: Path, n: int = 2000, seed: int = 0, **settings: Any) -> Manifest:
    """Train both models on ``n`` synthetic samples and publish them as the next version."""
    service = TrainerService(TrainerSettings(model_dir=model_dir, **settings))
    service.add_samples(training_samples(n, seed))
    manifest = await service.retrain()
    assert manifest is not None
    return manifest


def uncached_sweep(features: np.ndarray) -> np.ndarray:
    """One typical row, its uncached tokens swept from none to the whole prompt and beyond the data."""
    column = {name: i for i, name in enumerate(FEATURE_COLUMNS)}
    rows = np.repeat(np.median(features, axis=0, keepdims=True), 200, axis=0)
    length = np.linspace(0, 2 * features[:, column["input_token_length"]].max(), 200)
    rows[:, column["input_token_length"]] = length
    rows[:, column["prefix_cache_score"]] = 0.0
    rows[:, column["effective_input_tokens"]] = length
    return rows.astype(np.float32)
