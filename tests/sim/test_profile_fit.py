"""Fitting a profile: recovers known step and frontend terms, ignores stretched samples, loads back;
reports each term's confidence and residual, so a bad fit or a wrong model shape shows."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from sim.engine import (
    DecodeTerms,
    EngineConfig,
    FrontendTerms,
    IntakeTerms,
    PrefillTerms,
    StepCostModel,
    load_profile,
)
from sim.engine.cost_model import chunk_context_tokens
from sim.fitting.profile_fit import (
    FRONTEND_TERMS,
    INTAKE_TERMS,
    STEP_TERMS,
    FitError,
    FrontendSample,
    IntakeSample,
    StepSample,
    coefficient_lines,
    fit_frontend,
    fit_steps,
    lone_prefill,
    nonnegative_least_squares,
    render_profile,
    residual_lines,
    term_reports,
)

TRUE_COST = StepCostModel(
    PrefillTerms(base=0.5, per_token=0.009, per_context_token=1.5e-5),
    DecodeTerms(per_seq=0.05, per_context_token=2e-5),
    base=2.5,
)
TRUE_FRONTEND = FrontendTerms(base=5.0, per_prompt_token=0.004, per_running_request=0.4)
TRUE_INTAKE = IntakeTerms(base=0.6, per_prompt_token=0.0003)


def true_ms(sample: StepSample) -> float:
    return 1000 * TRUE_COST.step_time(
        sample.num_prefill_tokens,
        sample.prefill_context_tokens,
        sample.num_decode_seqs,
        sample.decode_context_tokens,
        0.0,
    )


def synthetic_steps(noise: float, seed: int = 1) -> list[StepSample]:
    """Lone prefills, decode batches and mixed steps like the probe's, timed by TRUE_COST ± noise."""
    rng = random.Random(seed)
    shapes = [lone_prefill(t, 0.0) for t in (16, 128, 256, 512, 1024, 1536, 2000) for _ in range(3)]
    for n, context in [
        (1, 40),
        (1, 1600),
        (4, 600),
        (8, 4000),
        (16, 1000),
        (16, 9000),
        (32, 5000),
        (48, 8000),
    ]:
        shapes.append(StepSample("decode", 0, 0, n, context, 0.0))
        for t in (64, 1024):
            shapes.append(StepSample("mixed", t, chunk_context_tokens(t, 0), n, context, 0.0))
    return [
        StepSample(s.kind, s.num_prefill_tokens, s.prefill_context_tokens, s.num_decode_seqs,
                   s.decode_context_tokens, true_ms(s) * (1 + rng.uniform(-noise, noise)))
        for s in shapes
    ]  # fmt: skip


def synthetic_frontend(noise: float = 0.0, seed: int = 1) -> list[FrontendSample]:
    """The simulator's TTFT without a frontend delay, and the real one: that plus TRUE_FRONTEND."""
    rng = random.Random(seed)
    samples = []
    for running in (0, 1, 4, 8, 16, 32):
        for tokens in (16, 256, 1024, 2000):
            sim_ttft = 3.0 + true_ms(lone_prefill(tokens, 0.0)) + 0.1 * running
            ttft = (sim_ttft + 1000 * TRUE_FRONTEND.delay(tokens, running)) * (1 + rng.uniform(-noise, noise))
            samples.append(FrontendSample(tokens, running, ttft, sim_ttft))
    return samples


def test_nnls_matches_least_squares_when_the_solution_is_positive_and_clamps_otherwise() -> None:
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, size=(40, 3)) * [1, 100, 1e5]  # columns of very different scales
    x = np.array([2.0, 0.03, 4e-5])
    assert nonnegative_least_squares(a, a @ x) == pytest.approx(x, rel=1e-6)
    b = a @ np.array([2.0, -0.03, 4e-5])
    clamped = nonnegative_least_squares(a, b)
    assert clamped[1] == 0.0 and (clamped >= 0).all()
    # Optimal among non-negative solutions: no single-term change lowers the error.
    best = np.linalg.norm(a @ clamped - b)
    for i in range(3):
        for delta in (1e-4, -1e-4):
            trial = clamped.copy()
            trial[i] = max(0.0, trial[i] + delta * max(abs(trial[i]), 1e-3))
            assert np.linalg.norm(a @ trial - b) >= best - 1e-9


def test_fit_recovers_known_terms_from_exact_samples() -> None:
    steps = fit_steps(synthetic_steps(noise=0.0))
    assert steps.cost.base == pytest.approx(TRUE_COST.base, rel=1e-4)
    assert steps.cost.prefill.base == pytest.approx(TRUE_COST.prefill.base, rel=1e-3)
    assert steps.cost.prefill.per_token == pytest.approx(TRUE_COST.prefill.per_token, rel=1e-4)
    assert steps.cost.prefill.per_context_token == pytest.approx(
        TRUE_COST.prefill.per_context_token, rel=1e-4
    )
    assert steps.cost.decode.base == pytest.approx(0.0, abs=1e-6)
    assert steps.cost.decode.per_seq == pytest.approx(TRUE_COST.decode.per_seq, rel=1e-4)
    assert steps.cost.decode.per_context_token == pytest.approx(TRUE_COST.decode.per_context_token, rel=1e-4)
    assert steps.outliers == 0
    assert set(steps.residuals) == {"prefill", "decode", "mixed"}
    assert all(r.max_pct < 0.1 for r in steps.residuals.values())

    frontend = fit_frontend(synthetic_frontend())
    assert frontend.terms.base == pytest.approx(TRUE_FRONTEND.base, rel=1e-6)
    assert frontend.terms.per_prompt_token == pytest.approx(TRUE_FRONTEND.per_prompt_token, rel=1e-6)
    assert frontend.terms.per_running_request == pytest.approx(TRUE_FRONTEND.per_running_request, rel=1e-6)
    assert frontend.outliers == 0 and frontend.residuals.max_pct < 0.1


def stretched(sample: StepSample, factor: float) -> StepSample:
    return StepSample(
        sample.kind,
        sample.num_prefill_tokens,
        sample.prefill_context_tokens,
        sample.num_decode_seqs,
        sample.decode_context_tokens,
        factor * sample.ms,
    )


def test_fit_tolerates_noise_and_leaves_out_stretched_samples() -> None:
    samples = synthetic_steps(noise=0.05)
    # Three steps slowed three-fold by other work on the machine.
    for index in (2, 30, 40):
        samples[index] = stretched(samples[index], 3.0)
    steps = fit_steps(samples)
    assert steps.outliers == 3
    for sample in synthetic_steps(noise=0.0, seed=2):
        predicted = 1000 * steps.cost.step_time(
            sample.num_prefill_tokens,
            sample.prefill_context_tokens,
            sample.num_decode_seqs,
            sample.decode_context_tokens,
            0.0,
        )
        assert predicted == pytest.approx(sample.ms, rel=0.06)

    frontend_samples = synthetic_frontend(noise=0.03)
    first = frontend_samples[5]
    frontend_samples[5] = FrontendSample(
        first.prompt_tokens, first.running, 4 * first.ttft_ms, first.sim_ttft_ms
    )
    frontend = fit_frontend(frontend_samples)
    assert frontend.outliers == 1
    for sample in synthetic_frontend(seed=3):
        predicted = sample.sim_ttft_ms + 1000 * frontend.terms.delay(sample.prompt_tokens, sample.running)
        assert predicted == pytest.approx(sample.ttft_ms, rel=0.05)


def synthetic_intake(noise: float = 0.0, seed: int = 1) -> list[IntakeSample]:
    """Lone requests' engine time outside their steps: TRUE_INTAKE ± noise."""
    rng = random.Random(seed)
    return [
        IntakeSample(tokens, 1000 * TRUE_INTAKE.time(tokens) * (1 + rng.uniform(-noise, noise)))
        for tokens in (16, 128, 256, 512, 1024, 1536, 2000)
        for _ in range(4)
    ]


def test_intake_is_fitted_beside_the_steps_and_reported_as_theirs() -> None:
    steps = fit_steps(synthetic_steps(noise=0.0), synthetic_intake())
    assert steps.cost.intake.base == pytest.approx(TRUE_INTAKE.base, rel=1e-4)
    assert steps.cost.intake.per_prompt_token == pytest.approx(TRUE_INTAKE.per_prompt_token, rel=1e-4)
    assert steps.cost.base == pytest.approx(TRUE_COST.base, rel=1e-4)  # the steps' own fit is unchanged
    assert [r.term for r in steps.terms] == [*STEP_TERMS, *INTAKE_TERMS]
    assert steps.residuals["intake"].count == 28 and steps.residuals["intake"].max_pct < 0.1
    noisy = fit_steps(synthetic_steps(noise=0.0), synthetic_intake(noise=0.2))
    assert noisy.cost.intake.base == pytest.approx(TRUE_INTAKE.base, rel=0.2)
    assert noisy.residuals["intake"].max_pct > 5  # the noise shows in the residual
    # Without intake samples the profile has none (an engine measured by its steps alone).
    assert fit_steps(synthetic_steps(noise=0.0)).cost.intake == IntakeTerms()
    with pytest.raises(FitError, match="intake samples must be positive"):
        fit_steps(synthetic_steps(noise=0.0), [IntakeSample(16, 0.0)] * 4)


def test_rendered_profile_loads_with_the_fitted_terms(tmp_path: Path) -> None:
    steps = fit_steps(synthetic_steps(noise=0.0), synthetic_intake())
    frontend = fit_frontend(synthetic_frontend())
    engine = EngineConfig(
        max_num_seqs=128, max_num_batched_tokens=2048, block_size=32, num_gpu_blocks=512, max_model_len=2048
    )
    header = ["first line", *residual_lines(steps, frontend)]
    text = render_profile(
        steps.cost,
        frontend.terms,
        engine,
        name="fitted",
        description="A test.",
        source="Synthetic.",
        header=header,
    )
    assert text.startswith("# first line\n# Residuals")
    assert "#   ttft " in text
    path = tmp_path / "fitted.yaml"
    path.write_text(text)
    profile = load_profile(path)
    assert profile.name == "fitted" and profile.engine == engine
    assert profile.cost.prefill.per_context_token == pytest.approx(1.5e-5, rel=1e-3)
    assert profile.cost.decode.base == 0.0 and profile.cost.decode.min == 0.0
    assert profile.frontend.per_running_request == pytest.approx(0.4, rel=1e-3)
    assert profile.cost.intake.per_prompt_token == pytest.approx(TRUE_INTAKE.per_prompt_token, rel=1e-3)


def test_too_few_or_unusable_samples_are_refused() -> None:
    with pytest.raises(FitError, match="too few"):
        fit_steps(synthetic_steps(noise=0.0)[:5])
    with pytest.raises(FitError, match="too few"):
        fit_frontend(synthetic_frontend()[:3])
    negative = [StepSample(s.kind, 0, 0, s.num_decode_seqs, 0, -1.0) for s in synthetic_steps(noise=0.0)]
    with pytest.raises(FitError, match="positive durations"):
        fit_steps(negative)


TRUE_STEP_TERMS = dict(zip(STEP_TERMS, (2.5, 0.5, 0.009, 1.5e-5, 0.0, 0.05, 2e-5), strict=True))


def test_every_term_reports_its_confidence_and_exact_samples_pin_every_term_down() -> None:
    steps, frontend = fit_steps(synthetic_steps(noise=0.0)), fit_frontend(synthetic_frontend())
    assert [r.term for r in steps.terms] == list(STEP_TERMS)
    assert [r.term for r in frontend.reports] == list(FRONTEND_TERMS)
    for report in steps.terms:
        true = TRUE_STEP_TERMS[report.term]
        assert report.low - 1e-9 <= true <= report.high + 1e-9
        assert report.std_error <= 1e-3 * max(true, 1e-3)
        assert report.residuals is not None and report.residuals.max_pct < 0.1
        assert report.trend_pct is None or abs(report.trend_pct) < 0.1
    per_seq = steps.terms[STEP_TERMS.index("decode.per_seq")]
    assert per_seq.samples == 24 and 0 < per_seq.share_pct < 100


def test_noise_widens_every_interval_and_the_true_terms_stay_within_three_standard_errors() -> None:
    quiet, noisy = fit_steps(synthetic_steps(noise=0.02)), fit_steps(synthetic_steps(noise=0.2))
    for calm, loud in zip(quiet.terms, noisy.terms, strict=True):
        if TRUE_STEP_TERMS[calm.term] > 0:
            assert loud.std_error > calm.std_error
    for report in (r for r in noisy.terms if TRUE_STEP_TERMS[r.term] > 0):
        assert abs(report.value - TRUE_STEP_TERMS[report.term]) <= 3 * report.std_error


def test_a_term_the_model_overcharges_shows_as_a_positive_trend_and_undercharges_as_a_negative() -> None:
    samples = synthetic_steps(noise=0.0)
    design = np.array([s.features() for s in samples])
    measured = np.array([s.ms for s in samples])
    per_seq = STEP_TERMS.index("decode.per_seq")
    for factor, sign in ((3.0, 1), (0.0, -1)):
        wrong = np.array(list(TRUE_STEP_TERMS.values()))
        wrong[per_seq] *= factor
        reports = term_reports(STEP_TERMS, design, np.zeros(len(samples)), measured, wrong, resamples=20)
        trend = reports[per_seq].trend_pct
        assert trend is not None and sign * trend > 5
        # Samples without decode sequences are untouched by the wrong term.
        assert reports[STEP_TERMS.index("prefill.per_token")].residuals.median_pct < 0.1


def test_the_coefficient_table_has_a_row_per_term_with_its_group() -> None:
    lines = coefficient_lines(fit_steps(synthetic_steps(noise=0.05)), fit_frontend(synthetic_frontend(0.05)))
    rows = [line for line in lines if line.startswith("| step_time_ms.") or line.startswith("| frontend_ms.")]
    assert len(rows) == len(STEP_TERMS) + len(FRONTEND_TERMS)
    assert rows[0].startswith("| step_time_ms.base | 2.")
    assert any(row.startswith("| frontend_ms.per_running_request |") for row in rows)
    assert all(row.count("|") == 9 for row in rows)


def test_a_fixed_cost_that_lands_in_the_decode_base_still_gives_a_valid_profile(tmp_path: Path) -> None:
    # The same steps as the probe's, timed by a model whose fixed decode cost is not shared.
    shifted = StepCostModel(
        PrefillTerms(base=2.5, per_token=0.009, per_context_token=1.5e-5),
        DecodeTerms(base=2.5, per_seq=0.05, per_context_token=2e-5),
    )

    def timed(s: StepSample) -> StepSample:
        ms = 1000 * shifted.step_time(
            s.num_prefill_tokens, s.prefill_context_tokens, s.num_decode_seqs, s.decode_context_tokens, 0.0
        )
        return dataclasses.replace(s, ms=ms)

    samples = [timed(s) for s in synthetic_steps(noise=0.0)]
    fit = fit_steps(samples)
    assert fit.cost.base == pytest.approx(0.0, abs=1e-6)
    assert fit.cost.decode.min == fit.cost.decode.base == pytest.approx(2.5, rel=1e-4)
    path = tmp_path / "p.yaml"
    text = render_profile(
        fit.cost, TRUE_FRONTEND, EngineConfig(), name="p", description="d", source="s", header=[]
    )
    path.write_text(text)
    assert load_profile(path).cost.decode.min == pytest.approx(2.5, rel=1e-3)
