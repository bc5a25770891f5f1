"""The metering benchmark's arithmetic and report (the measuring itself needs the live stack)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.runs import metering_cost
from bench.runs.metering_cost import MeteringCostSettings, shipped


def _result(mode: str, epp: tuple[float, float], envoy: tuple[float, float]) -> dict:
    cells = [
        {"tokens": n, "window_s": 12.0, "epp_ms": e, "envoy_ms": v}
        for n, e, v in zip((1, 512), epp, envoy, strict=True)
    ]
    accuracy = {"requests": 10, "output_tokens": 1000, "output_tokens_counted": 990, "mape": {"ttft": 0.1}}
    plain = {"tokens": 16, "window_s": 12.0, "epp_ms": epp[0] / 2, "envoy_ms": envoy[0]}
    return {"mode": mode, "idle_ms_per_s": 3.0, "cells": cells, "plain": plain, "accuracy": accuracy}


def test_the_shipped_mean_weighs_the_streams_read_whole_by_the_sampling() -> None:
    full = _result("full", (2.0, 82.0), (1.0, 60.0))
    first = _result("first-token", (2.0, 2.2), (1.0, 30.0))
    mean = shipped(full, first, sample_every=100)
    assert [c["epp_ms"] for c in mean] == pytest.approx([2.0, 0.99 * 2.2 + 0.82])
    assert [c["envoy_ms"] for c in mean] == pytest.approx([1.0, 0.99 * 30.0 + 0.6])
    assert shipped(full, first, sample_every=1)[1]["epp_ms"] == pytest.approx(82.0)


def test_the_report_gives_each_meterings_ratio_and_a_plot(tmp_path: Path, monkeypatch) -> None:
    results = {
        "full": _result("full", (2.0, 82.0), (1.0, 60.0)),
        "first-token": _result("first-token", (1.5, 3.0), (1.0, 30.0)),
    }
    monkeypatch.setattr(metering_cost, "measure", lambda mode, settings: results[mode])
    data = metering_cost.run(tmp_path, MeteringCostSettings())
    report = (tmp_path / "metering.md").read_text()
    assert "| full | 41.00× | 60.00× |" in report
    assert "| first-token | 2.00× | 30.00× |" in report
    assert "| full | 1.00 | 1.00 |" in report and "| first-token | 0.75 | 1.00 |" in report  # non-streamed
    assert f"1 in {metering_cost.SHIPPED_SAMPLE_EVERY} read whole (shipped)" in report
    assert "| first-token | 990 / 1000 | 0.100 | nan |" in report
    assert (tmp_path / data["plot"]).stat().st_size > 0 and (tmp_path / "metering.json").exists()


def test_the_newest_model_versions_mape_is_taken_for_each_target() -> None:
    samples = {
        ("llm_epp_prediction_mape", (("model_version", "2"), ("target", "ttft"))): 0.2,
        ("llm_epp_prediction_mape", (("model_version", "10"), ("target", "ttft"))): 0.1,
        ("llm_epp_prediction_mape", (("model_version", "3"), ("target", "tpot"))): 0.3,
        ("llm_epp_prediction_bias", (("model_version", "11"), ("target", "ttft"))): 0.9,
    }
    assert metering_cost.newest_mape(samples) == {"ttft": 0.1, "tpot": 0.3}
