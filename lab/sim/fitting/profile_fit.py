"""Fitting a simulator profile to measurements of a real engine: least squares, and the YAML.

Two fits, in this order (``sim.fitting.profile_probe`` measures what each needs):

1. ``fit_steps``: the ``sim.engine.cost_model`` step terms, from ``StepSample`` (one engine
   step each: what it computed and how long it took by the engine's own clock; prefill-only,
   decode-only and mixed steps).
2. ``fit_frontend``: the ``FrontendTerms``, from ``FrontendSample``: the real server's time to
   first token of a request, next to the simulator's for the same request in the same situation
   when it runs the fitted steps with no frontend delay. The delay is what the simulator lacks.

Both minimise squared *relative* error (a 3 ms step matters as much as a 60 ms one), with every
term non-negative (Lawson–Hanson NNLS) as profiles require; samples far off a first fit are left
out of the second (``OUTLIER_MADS``).

Each fit also reports every term's confidence and residual (``TermReport``): a bootstrap over the
samples (refitting ``BOOTSTRAP_RESAMPLES`` resamples, outlier trimming included) gives the term's
standard error and 90% interval, and the samples the term applies to give its median share of
the modelled time, how far the model misses them, and the trend of the signed miss as the term's
column grows. A term whose interval reaches far either side of its value, whose samples the
model misses by much more than the others, or whose trend is far from 0, is one the probes do
not pin down or the model does not have the right shape for.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.engine import DecodeTerms, EngineConfig, FrontendTerms, IntakeTerms, PrefillTerms, StepCostModel
from sim.engine.cost_model import chunk_context_tokens

STEP_TERMS = (
    "base",
    "prefill.base",
    "prefill.per_token",
    "prefill.per_context_token",
    "decode.base",
    "decode.per_seq",
    "decode.per_context_token",
)
"""The step-time terms fitted, in column order. Dynamo's ``per_token_sq`` and the KV-usage terms
are left at 0: the attention terms (``per_context_token``) describe the same cost physically."""


INTAKE_TERMS = ("intake.base", "intake.per_prompt_token")
"""The intake terms (``IntakeTerms``), fitted apart from the step terms on their own samples."""

FRONTEND_TERMS = ("base", "per_prompt_token", "per_running_request")
"""The frontend terms fitted, in column order."""

BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_SEED = 0

OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.25
"""A sample is an outlier if the first fit misses it by more than ``OUTLIER_MADS`` times the
median relative error, and by more than ``OUTLIER_FLOOR``."""


class FitError(ValueError):
    """The samples cannot give a usable profile."""


@dataclass(frozen=True, slots=True)
class StepSample:
    kind: str
    """``"prefill"``, ``"decode"`` or ``"mixed"``: which residual group the sample reports in."""
    num_prefill_tokens: int
    prefill_context_tokens: int
    num_decode_seqs: int
    decode_context_tokens: int
    ms: float

    def features(self) -> list[float]:
        """The sample's row of the design matrix, in ``STEP_TERMS`` order."""
        prefill, decode = self.num_prefill_tokens > 0, self.num_decode_seqs > 0
        return [
            1.0,
            float(prefill),
            float(self.num_prefill_tokens),
            float(self.prefill_context_tokens),
            float(decode),
            float(self.num_decode_seqs),
            float(self.decode_context_tokens),
        ]


@dataclass(frozen=True, slots=True)
class IntakeSample:
    """Engine time one request took outside its steps, by the engine process's CPU clocks."""

    prompt_tokens: int
    ms: float


@dataclass(frozen=True, slots=True)
class FrontendSample:
    """Time to first token of requests of one prompt length arriving while ``running`` requests
    decode, on the real server and on the simulator (fitted steps, no frontend delay)."""

    prompt_tokens: int
    running: int
    ttft_ms: float
    sim_ttft_ms: float


@dataclass(frozen=True, slots=True)
class Residuals:
    """How far the fitted model is from the samples of one group, as |model − measured| / measured."""

    count: int
    median_pct: float
    p90_pct: float
    max_pct: float


@dataclass(frozen=True, slots=True)
class TermReport:
    """One fitted term: its value with a bootstrap confidence, and how well the model fits the
    samples the term applies to (those whose column for it is not 0)."""

    term: str
    value: float
    std_error: float
    """Standard deviation of the term over the bootstrap refits."""
    low: float
    high: float
    """The 5th and 95th percentiles of the term over the bootstrap refits."""
    samples: int
    share_pct: float
    """Median share of the modelled value that this term contributes, over its samples (%)."""
    residuals: Residuals | None
    """|model − measured| / measured over its samples; None where it applies to none."""
    trend_pct: float | None = None
    """Mean signed error (model − measured) / measured of the samples where the term's column is
    above its median, less that of the rest (%): positive where the model charges too much for
    the term's growth, negative where too little; None for a column that does not vary."""


@dataclass(frozen=True, slots=True)
class StepFit:
    cost: StepCostModel
    residuals: dict[str, Residuals]
    """Per step kind, over all samples, outliers included."""
    outliers: int
    """Samples left out of the final fit (see ``OUTLIER_MADS``)."""
    terms: tuple[TermReport, ...] = ()
    """Per term of ``STEP_TERMS``, then of ``INTAKE_TERMS`` where intake was fitted."""


@dataclass(frozen=True, slots=True)
class FrontendFit:
    terms: FrontendTerms
    residuals: Residuals
    """Of the TTFT the simulator would have with the delay, over all samples."""
    outliers: int
    reports: tuple[TermReport, ...] = ()
    """Per term of ``FRONTEND_TERMS``, in that order."""


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """``argmin ‖a·x − b‖`` subject to ``x ≥ 0`` (Lawson and Hanson's active-set method).

    Columns are scaled to unit norm first, so terms of very different magnitude (1 and 10⁶)
    converge alike.
    """
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(passive, -np.inf, gradient)
        if passive.all() or candidates.max() <= tol:
            break
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x towards z until the first passive term reaches 0, and drop it.
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x / scale


def step_cost_model(coefficients: Sequence[float]) -> StepCostModel:
    """The cost model of coefficients in ``STEP_TERMS`` order. The decode floor is ``decode.base``,
    which the decode polynomial (all terms ≥ 0) never goes below: it changes no step time, and keeps
    a profile valid where the shared ``base`` came out 0 (noisy probes can move the fixed cost of a
    step between the shared and the decode base)."""
    c = dict(zip(STEP_TERMS, coefficients, strict=True))
    return StepCostModel(
        prefill=PrefillTerms(
            base=c["prefill.base"],
            per_token=c["prefill.per_token"],
            per_context_token=c["prefill.per_context_token"],
        ),
        decode=DecodeTerms(
            base=c["decode.base"],
            per_seq=c["decode.per_seq"],
            per_context_token=c["decode.per_context_token"],
            min=c["decode.base"],
        ),
        base=c["base"],
    )


def lone_prefill(prompt_tokens: int, ms: float) -> StepSample:
    """The step that prefills one uncached prompt and nothing else."""
    return StepSample("prefill", prompt_tokens, chunk_context_tokens(prompt_tokens, 0), 0, 0, ms)


def predicted_ms(cost: StepCostModel, sample: StepSample) -> float:
    return 1000.0 * cost.step_time(
        sample.num_prefill_tokens,
        sample.prefill_context_tokens,
        sample.num_decode_seqs,
        sample.decode_context_tokens,
        0.0,
    )


def fit_steps(steps: Sequence[StepSample], intake: Sequence[IntakeSample] = ()) -> StepFit:
    """The step terms that best explain ``steps``, and the intake terms ``intake`` (none without
    samples)."""
    if len(steps) < 2 * len(STEP_TERMS):
        raise FitError(f"{len(steps)} step samples are too few for {len(STEP_TERMS)} terms")
    measured = np.array([s.ms for s in steps])
    if (measured <= 0).any():
        raise FitError("step samples must have positive durations")
    design = np.array([s.features() for s in steps])
    coefficients, inliers = _trimmed_fit(design / measured[:, None], np.ones(len(steps)))
    reports = term_reports(STEP_TERMS, design, np.zeros(len(steps)), measured, coefficients)
    cost = step_cost_model(coefficients)
    if cost.base + cost.decode.base <= 0:
        raise FitError("the fit found no fixed cost per step; the samples cannot be engine steps")
    residuals = {
        kind: _residuals(
            [predicted_ms(cost, s) for s in steps if s.kind == kind], [s.ms for s in steps if s.kind == kind]
        )
        for kind in sorted({s.kind for s in steps})
    }
    outliers = int((~inliers).sum())
    if intake:
        terms, intake_residuals, intake_outliers, intake_reports = _fit_intake(intake)
        cost = dataclasses.replace(cost, intake=terms)
        residuals["intake"] = intake_residuals
        outliers += intake_outliers
        reports += intake_reports
    return StepFit(cost, residuals, outliers, reports)


def _fit_intake(
    samples: Sequence[IntakeSample],
) -> tuple[IntakeTerms, Residuals, int, tuple[TermReport, ...]]:
    """``IntakeTerms`` by the same relative least squares as the steps, with their residuals,
    outliers left out and term reports."""
    if len(samples) < 2 * len(INTAKE_TERMS):
        raise FitError(f"{len(samples)} intake samples are too few for {len(INTAKE_TERMS)} terms")
    measured = np.array([s.ms for s in samples])
    if (measured <= 0).any():
        raise FitError("intake samples must be positive: the engine's threads ran for every request")
    design = np.array([[1.0, float(s.prompt_tokens)] for s in samples])
    coefficients, inliers = _trimmed_fit(design / measured[:, None], np.ones(len(samples)))
    reports = term_reports(INTAKE_TERMS, design, np.zeros(len(samples)), measured, coefficients)
    terms = IntakeTerms(*(float(c) for c in coefficients))
    predicted = [1000 * terms.time(s.prompt_tokens) for s in samples]
    return terms, _residuals(predicted, list(measured)), int((~inliers).sum()), reports


def fit_frontend(samples: Sequence[FrontendSample]) -> FrontendFit:
    """The frontend terms that best close the gap between the simulator's TTFT and the real one."""
    if len(samples) < 6:
        raise FitError(f"{len(samples)} frontend samples are too few for 3 terms")
    ttft = np.array([s.ttft_ms for s in samples])
    design = np.array([[1.0, s.prompt_tokens, s.running] for s in samples])
    sim_ttft = np.array([s.sim_ttft_ms for s in samples])
    coefficients, inliers = _trimmed_fit(design / ttft[:, None], (ttft - sim_ttft) / ttft)
    reports = term_reports(FRONTEND_TERMS, design, sim_ttft, ttft, coefficients)
    terms = FrontendTerms(*(float(c) for c in coefficients))
    predicted = [s.sim_ttft_ms + 1000 * terms.delay(s.prompt_tokens, s.running) for s in samples]
    return FrontendFit(terms, _residuals(predicted, list(ttft)), int((~inliers).sum()), reports)


def term_reports(
    names: Sequence[str],
    design: np.ndarray,
    offset: np.ndarray,
    measured: np.ndarray,
    coefficients: np.ndarray,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[TermReport, ...]:
    """Confidence and residual of each term of a fit of ``measured ≈ offset + design·x`` (relative
    error, as ``_trimmed_fit``) whose result is ``coefficients``: the fit is repeated on
    ``resamples`` bootstrap resamples of the rows (same seed, same intervals)."""
    a, b = design / measured[:, None], (measured - offset) / measured
    rng = np.random.default_rng(seed)
    refits = np.array(
        [_trimmed_fit(a[rows], b[rows])[0] for rows in rng.integers(0, len(b), size=(resamples, len(b)))]
    )
    contributions = design * coefficients
    predicted = offset + contributions.sum(axis=1)
    reports = []
    for j, name in enumerate(names):
        rows = design[:, j] != 0
        share = contributions[rows, j] / np.where(predicted[rows] == 0, 1.0, predicted[rows])
        reports.append(
            TermReport(
                term=name,
                value=float(coefficients[j]),
                std_error=float(refits[:, j].std()),
                low=float(np.percentile(refits[:, j], 5)),
                high=float(np.percentile(refits[:, j], 95)),
                samples=int(rows.sum()),
                share_pct=round(100 * float(np.median(share)), 1) if rows.any() else 0.0,
                residuals=_residuals(predicted[rows], measured[rows]) if rows.any() else None,
                trend_pct=_trend(design[rows, j], (predicted[rows] - measured[rows]) / measured[rows]),
            )
        )
    return tuple(reports)


def _trend(column: np.ndarray, signed_errors: np.ndarray) -> float | None:
    high = column > np.median(column)
    if not high.any() or high.all():
        return None
    return round(100 * float(signed_errors[high].mean() - signed_errors[~high].mean()), 1)


def _trimmed_fit(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares of rows already scaled to relative error, refitted without the
    rows the first fit misses by far (see ``OUTLIER_MADS``); the coefficients and the rows kept.

    On a shared machine a measurement is sometimes stretched several-fold by other work; left in,
    a few of them bend every term.
    """
    errors = np.abs(a @ nonnegative_least_squares(a, b) - b)
    inliers = errors <= max(OUTLIER_FLOOR, OUTLIER_MADS * float(np.median(errors)))
    return nonnegative_least_squares(a[inliers], b[inliers]), inliers


def _residuals(predicted: Sequence[float], measured: Sequence[float]) -> Residuals:
    errors = 100.0 * np.abs(np.array(predicted) - np.array(measured)) / np.array(measured)
    return Residuals(
        count=len(errors),
        median_pct=round(float(np.median(errors)), 1),
        p90_pct=round(float(np.percentile(errors, 90)), 1),
        max_pct=round(float(errors.max()), 1),
    )


def render_profile(
    cost: StepCostModel,
    frontend: FrontendTerms,
    engine: EngineConfig,
    *,
    name: str,
    description: str,
    source: str,
    header: Sequence[str],
) -> str:
    """The profile YAML (``sim.engine.profile``'s format), ``header`` lines as a leading comment."""
    p, d = cost.prefill, cost.decode
    lines = [f"# {line}".rstrip() for line in header]
    lines += [
        f"name: {name}",
        "description: >",
        textwrap.fill(description, 96, initial_indent="  ", subsequent_indent="  "),
        "source: >",
        textwrap.fill(source, 96, initial_indent="  ", subsequent_indent="  "),
        "engine:",
        f"  block_size: {engine.block_size}",
        f"  num_gpu_blocks: {engine.num_gpu_blocks}",
        f"  max_num_seqs: {engine.max_num_seqs}",
        f"  max_num_batched_tokens: {engine.max_num_batched_tokens}",
        f"  max_model_len: {engine.max_model_len}",
        "step_time_ms:",
        f"  base: {_number(cost.base)}",
        "  prefill:",
        f"    base: {_number(p.base)}",
        f"    per_token: {_number(p.per_token)}",
        f"    per_context_token: {_number(p.per_context_token)}",
        "  decode:",
        f"    base: {_number(d.base)}",
        f"    per_seq: {_number(d.per_seq)}",
        f"    per_context_token: {_number(d.per_context_token)}",
        f"    min: {_number(d.min)}",
        "  intake:",
        f"    base: {_number(cost.intake.base)}",
        f"    per_prompt_token: {_number(cost.intake.per_prompt_token)}",
        "frontend_ms:",
        f"  base: {_number(frontend.base)}",
        f"  per_prompt_token: {_number(frontend.per_prompt_token)}",
        f"  per_running_request: {_number(frontend.per_running_request)}",
    ]
    return "\n".join(lines) + "\n"


def residual_lines(steps: StepFit, frontend: FrontendFit) -> list[str]:
    """The fits' residuals, one line per group, for a profile's header."""
    groups = {**steps.residuals, "ttft": frontend.residuals}
    return [
        f"Residuals, |model - measured| / measured ({steps.outliers} step and {frontend.outliers} "
        "TTFT outliers left out of the fits):",
        *(
            f"  {kind:<8} {r.count:>3} samples: median {r.median_pct}%, p90 {r.p90_pct}%, max {r.max_pct}%"
            for kind, r in groups.items()
        ),
    ]


def coefficient_lines(steps: StepFit, frontend: FrontendFit) -> list[str]:
    """Every fitted term with its bootstrap confidence and the residual over its samples, as a
    Markdown table (one line per row), for a profile's header and the fidelity report."""
    rows = [("step_time_ms", report) for report in steps.terms]
    rows += [("frontend_ms", report) for report in frontend.reports]
    lines = [
        f"Fitted terms ({BOOTSTRAP_RESAMPLES} bootstrap refits; residual over the samples each term "
        "applies to):",
        "| term | value | std. error | 90% interval | samples | median share | residual median / p90 "
        "| trend |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, r in rows:
        residual = f"{r.residuals.median_pct}% / {r.residuals.p90_pct}%" if r.residuals else "–"
        trend = "–" if r.trend_pct is None else f"{r.trend_pct:+.1f}%"
        lines.append(
            f"| {group}.{r.term} | {r.value:.4g} | {r.std_error:.2g} | {r.low:.3g} – {r.high:.3g} "
            f"| {r.samples} | {r.share_pct}% | {residual} | {trend} |"
        )
    return lines


def _number(value: float) -> str:
    """Four significant digits, in a form YAML reads as a float."""
    if value == 0 or not math.isfinite(value):
        return "0.0"
    # PyYAML reads 1e-05 as a string: the mantissa needs a point.
    mantissa, e, exponent = f"{value:.4g}".partition("e")
    return (mantissa if "." in mantissa else f"{mantissa}.0") + e + exponent
