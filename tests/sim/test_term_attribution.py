"""Term attribution: the fidelity workload in virtual time, with each step term removed in turn."""

from __future__ import annotations

import dataclasses

import pytest

from sim.engine import DecodeTerms, FrontendTerms, PrefillTerms, Profile, StepCostModel, load_profile
from sim.fitting.term_attribution import attribution, replay, without, workload
from sim.fitting.workload import poisson_workload

COST = StepCostModel(
    PrefillTerms(base=0.5, per_token=0.01, per_context_token=1.5e-5),
    DecodeTerms(per_seq=0.02, per_context_token=1e-4),
    base=2.0,
)


def profile() -> Profile:
    tiny = load_profile("instant")
    engine = dataclasses.replace(tiny.engine, max_num_batched_tokens=2048, num_gpu_blocks=4096, block_size=32)
    return dataclasses.replace(tiny, cost=COST, frontend=FrontendTerms(base=5.0), engine=engine)


def test_the_workload_has_the_fidelity_benchs_lengths_and_arrivals() -> None:
    ours = workload(3.0, seconds=5.0, seed=43)
    theirs = poisson_workload(rate=3.0, count=15, prompt_tokens=(50, 1500), output_tokens=(16, 256), seed=43)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in ours] == [
        (item.arrival_s, item.prompt_tokens, item.output_tokens) for item in theirs
    ]


def test_without_sets_exactly_one_term_to_zero() -> None:
    p = profile()
    assert without(p, "base").cost == dataclasses.replace(COST, base=0.0)
    assert without(p, "decode.per_context_token").cost.decode == DecodeTerms(per_seq=0.02)
    assert without(p, "prefill.per_token").cost.prefill.per_token == 0.0
    assert without(p, "prefill.per_token").cost.prefill.base == 0.5


def test_a_lone_request_decodes_at_one_step_per_token_after_the_front_end_and_its_prefill() -> None:
    p = profile()
    [request] = workload(0.1, seconds=1.0)[:1]
    ttft, tpot = replay(p, [request])
    t = request.prompt_tokens
    assert ttft == pytest.approx(5.0 + 2.0 + 0.5 + 0.01 * t + 1.5e-5 * t * (t + 1) / 2)
    # Decode step k (0-based) of the request attends to its prompt and the k + 1 tokens so far.
    contexts = [t + k + 1 for k in range(request.output_tokens - 1)]
    assert tpot == pytest.approx(2.0 + 0.02 + 1e-4 * sum(contexts) / len(contexts))


def test_terms_that_grow_with_the_batch_make_tpot_climb_with_load_and_zero_terms_are_not_listed() -> None:
    rows = attribution(profile(), [1.0, 12.0])
    assert "without decode.base" not in rows and "without prefill.base" in rows
    fitted = rows["as fitted"]
    assert fitted[1] > fitted[0]
    flat = rows["without decode.per_context_token"]
    assert flat[1] / flat[0] < fitted[1] / fitted[0]
