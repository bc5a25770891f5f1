"""The H100 profile against a published measurement of the same model on the same GPU, and the
replay that predicts such a measurement (pure: virtual time)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.runs.published_check import Point, load_measurement, predict, run, served_as
from sim.engine import DecodeTerms, FrontendTerms, PrefillTerms, StepCostModel, load_profile

STATED_ERRORS_PCT = {
    # point: (TTFT mean, TPOT median), (predicted − published) / published, as docs/simulator-fidelity.md
    # and the README state them; the cause is vLLM 0.6's engine and front end against BLIS's 0.8.4 fit.
    "10 requests at once": (-48.0, -23.4),
    "80 requests at once": (-78.5, -17.1),
}


@pytest.mark.parametrize("name", sorted(STATED_ERRORS_PCT))
def test_the_h100_profile_stays_within_its_stated_error_of_the_published_figures(name: str) -> None:
    measurement = load_measurement()
    profile = served_as(load_profile("llama-3.1-8b-h100"), measurement)
    [point] = [p for p in measurement.points if p.name == name]
    comparison = predict(profile, point)
    ttft, tpot = STATED_ERRORS_PCT[name]
    assert comparison.ttft_error_pct == pytest.approx(ttft, abs=2.0)
    assert comparison.tpot_error_pct == pytest.approx(tpot, abs=2.0)


def test_the_served_engine_limits_replace_the_profiles_and_nothing_else() -> None:
    measurement = load_measurement()
    profile = load_profile("llama-3.1-8b-h100")
    served = served_as(profile, measurement)
    assert served.engine.max_num_batched_tokens == 2048 and served.engine.max_model_len == 2048
    assert served.engine.num_gpu_blocks == profile.engine.num_gpu_blocks
    assert served.cost == profile.cost and served.frontend == profile.frontend


def test_a_lone_request_takes_the_front_end_then_one_prefill_then_a_decode_step_per_token() -> None:
    cost = StepCostModel(PrefillTerms(per_token=0.01), DecodeTerms(base=2.0, min=2.0), base=1.0)
    profile = dataclasses.replace(load_profile("instant"), cost=cost, frontend=FrontendTerms(base=0.5))
    comparison = predict(profile, Point("one", (100,), (11,), mean_ttft_ms=10.0, median_tpot_ms=3.0))
    # 0.5 ms front end + (1 + 0.01 × 100) ms prefill; then 10 decode steps of 1 + 2 ms.
    assert comparison.mean_ttft_ms == pytest.approx(2.5)
    assert comparison.median_tpot_ms == pytest.approx(3.0)
    assert comparison.ttft_error_pct == pytest.approx(-75.0) and comparison.tpot_error_pct == pytest.approx(
        0.0
    )


def test_a_request_that_returned_nothing_counts_as_zero_in_the_mean_ttft_and_not_in_tpot() -> None:
    cost = StepCostModel(PrefillTerms(per_token=0.01), DecodeTerms(base=2.0, min=2.0), base=1.0)
    profile = dataclasses.replace(load_profile("instant"), cost=cost, frontend=FrontendTerms())
    alone = predict(profile, Point("one", (100,), (11,), 1.0, 1.0))
    with_empty = predict(profile, Point("two", (100, 50), (11, 0), 1.0, 1.0))
    assert with_empty.mean_ttft_ms == pytest.approx(alone.mean_ttft_ms / 2)
    assert with_empty.median_tpot_ms == pytest.approx(alone.median_tpot_ms)


def test_the_bench_writes_the_comparison_with_its_source(tmp_path: Path) -> None:
    data = run(tmp_path)
    assert [p["name"] for p in data["points"]] == sorted(STATED_ERRORS_PCT)
    report = (tmp_path / "published_check.md").read_text()
    assert "LambdaLabsML/vllm-benchmark" in report and "| 10 requests at once | 62.4 |" in report
