"""Fitting a profile to step samples: recovers known terms, ignores stretched steps, writes loadable YAML."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from bench.profile_fit import (
    FitError,
    FrontendSample,
    StepSample,
    fit_profile,
    lone_prefill,
    nonnegative_least_squares,
    render_profile,
)
from sim.engine import DecodeTerms, EngineConfig, FrontendTerms, PrefillTerms, StepCostModel, load_profile
from sim.engine.cost_model import chunk_context_tokens

TRUE_COST = StepCostModel(
    PrefillTerms(base=0.5, per_token=0.009, per_context_token=1.5e-5),
    DecodeTerms(per_seq=0.05, per_context_token=2e-5),
    base=2.5,
)
TRUE_FRONTEND = FrontendTerms(base=5.0, per_prompt_token=0.004)


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


def synthetic_frontend() -> list[FrontendSample]:
    samples = []
    for tokens in (16, 256, 1024, 2000):
        engine_ms = true_ms(lone_prefill(tokens, 0.0))
        own_ms = 1.0 + 0.002 * tokens
        ttft = 1000 * TRUE_FRONTEND.delay(tokens) + engine_ms + own_ms
        samples.append(FrontendSample(tokens, ttft, engine_ms, own_ms))
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
    fit = fit_profile(synthetic_steps(noise=0.0), synthetic_frontend())
    assert fit.cost.base == pytest.approx(TRUE_COST.base, rel=1e-4)
    assert fit.cost.prefill.base == pytest.approx(TRUE_COST.prefill.base, rel=1e-3)
    assert fit.cost.prefill.per_token == pytest.approx(TRUE_COST.prefill.per_token, rel=1e-4)
    assert fit.cost.prefill.per_context_token == pytest.approx(TRUE_COST.prefill.per_context_token, rel=1e-4)
    assert fit.cost.decode.base == pytest.approx(0.0, abs=1e-6)
    assert fit.cost.decode.per_seq == pytest.approx(TRUE_COST.decode.per_seq, rel=1e-4)
    assert fit.cost.decode.per_context_token == pytest.approx(TRUE_COST.decode.per_context_token, rel=1e-4)
    assert fit.frontend.base == pytest.approx(TRUE_FRONTEND.base, rel=1e-6)
    assert fit.frontend.per_prompt_token == pytest.approx(TRUE_FRONTEND.per_prompt_token, rel=1e-6)
    assert fit.outliers == 0
    assert all(r.max_pct < 0.1 for r in fit.residuals.values())
    assert set(fit.residuals) == {"prefill", "decode", "mixed", "ttft"}


def test_fit_tolerates_noise_and_leaves_out_stretched_steps() -> None:
    steps = synthetic_steps(noise=0.05)
    # Three steps slowed three-fold by other work on the machine.
    steps[2], steps[30], steps[40] = (
        StepSample(s.kind, s.num_prefill_tokens, s.prefill_context_tokens, s.num_decode_seqs,
                   s.decode_context_tokens, 3 * s.ms)
        for s in (steps[2], steps[30], steps[40])
    )  # fmt: skip
    fit = fit_profile(steps, synthetic_frontend())
    assert fit.outliers == 3
    for sample in synthetic_steps(noise=0.0, seed=2):
        predicted = 1000 * fit.cost.step_time(
            sample.num_prefill_tokens, sample.prefill_context_tokens, sample.num_decode_seqs,
            sample.decode_context_tokens, 0.0,
        )  # fmt: skip
        assert predicted == pytest.approx(sample.ms, rel=0.06)


def test_rendered_profile_loads_with_the_fitted_terms(tmp_path: Path) -> None:
    fit = fit_profile(synthetic_steps(noise=0.0), synthetic_frontend())
    engine = EngineConfig(
        max_num_seqs=128, max_num_batched_tokens=2048, block_size=32, num_gpu_blocks=512, max_model_len=2048
    )
    text = render_profile(
        fit,
        engine,
        name="fitted",
        description="A test.",
        source="Synthetic.",
        header=["first line", "second"],
    )
    assert text.startswith("# first line\n# second\n# Residuals")
    path = tmp_path / "fitted.yaml"
    path.write_text(text)
    profile = load_profile(path)
    assert profile.name == "fitted" and profile.engine == engine
    assert profile.cost.prefill.per_context_token == pytest.approx(1.5e-5, rel=1e-3)
    assert profile.cost.decode.base == 0.0 and profile.cost.decode.min == 0.0
    assert profile.frontend.base == pytest.approx(5.0, rel=1e-3)


def test_too_few_or_unusable_samples_are_refused() -> None:
    with pytest.raises(FitError, match="too few"):
        fit_profile(synthetic_steps(noise=0.0)[:5], synthetic_frontend())
    with pytest.raises(FitError, match="no frontend samples"):
        fit_profile(synthetic_steps(noise=0.0), [])
    negative = [StepSample(s.kind, 0, 0, s.num_decode_seqs, 0, -1.0) for s in synthetic_steps(noise=0.0)]
    with pytest.raises(FitError, match="positive durations"):
        fit_profile(negative, synthetic_frontend())
