"""``Engine.fast_forward_decode`` leaves exactly the state the step loop would."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sim.engine import (
    DecodeTerms,
    Engine,
    EngineConfig,
    EngineRequest,
    IntakeTerms,
    PrefillTerms,
    StepCostModel,
)

# Decode time grows with KV usage and context, so every fast-forwarded step has its own duration;
# requests arriving at a full batch take intake time from the steps that the fast path must not skip.
COST = StepCostModel(
    PrefillTerms(base=1.0, per_token=0.01),
    DecodeTerms(base=1.0, per_seq=0.01, per_context_token=0.0001, kv_fraction=3.0, kv_fraction_sq=-1.0),
    intake=IntakeTerms(base=0.3, per_prompt_token=0.002),
)


def _engine(num_gpu_blocks: int) -> Engine:
    config = EngineConfig(
        max_num_seqs=6,
        max_num_batched_tokens=64,
        block_size=4,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=512,
    )
    return Engine(config, COST, range(100, 200))


def _workload(seed: int) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    shared = list(range(5000, 5000 + 23))
    items, now = [], 0.0
    for index in range(40):
        now += rng.expovariate(20.0)
        body = [rng.randrange(1000, 4000) for _ in range(rng.randint(1, 40))]
        prompt = (shared if rng.random() < 0.5 else []) + body
        stop = rng.choice([None, rng.randint(1, 60)])
        items.append((now, EngineRequest(f"r{index}", prompt, rng.randint(1, 90), stop_after_tokens=stop)))
    return items


def _replay(engine: Engine, items: list[tuple[float, EngineRequest]], *, fast: bool, seed: int) -> float:
    """Arrivals interleaved with steps; ``fast`` skips decode-only stretches up to random horizons."""
    rng = random.Random(seed)
    pending = list(items)
    now, step = 0.0, None
    skipped = 0
    while pending or engine.has_unfinished_requests():
        next_arrival = pending[0][0] if pending else float("inf")
        if step is not None and step.end_time <= next_arrival:
            now = step.end_time
            engine.finish_step(step, now)
            if fast:
                horizon = min(next_arrival, now + rng.uniform(0.0, 0.2))
                now, steps = engine.fast_forward_decode(now, horizon)
                skipped += steps
            step = engine.schedule(now)
            continue
        now = next_arrival
        engine.add_request(pending.pop(0)[1], now)
        if step is None:
            step = engine.schedule(now)
    return skipped


def _state(engine: Engine, items: list[tuple[float, EngineRequest]]) -> dict:
    kv = engine.kv_cache
    return {
        "requests": [
            (r.request_id, r.output_token_ids, r.first_token_time, r.finish_time, r.num_cached_tokens)
            for _, r in items
        ],
        # Summed step by step or in one stretch, the modelled busy time differs in the last bits.
        "counters": dataclasses.replace(engine.counters, busy_seconds=round(engine.counters.busy_seconds, 9)),
        "free": [(b.block_id, b.block_hash) for b in kv._free.values()],
        "cached": {digest: [b.block_id for b in blocks] for digest, blocks in kv._cached.items()},
    }


@pytest.mark.parametrize("num_gpu_blocks", [400, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_forward_equals_the_step_loop(seed: int, num_gpu_blocks: int) -> None:
    slow, fast = _engine(num_gpu_blocks), _engine(num_gpu_blocks)
    slow_items, fast_items = _workload(seed), _workload(seed)
    _replay(slow, slow_items, fast=False, seed=seed)
    skipped = _replay(fast, fast_items, fast=True, seed=seed)
    assert skipped > 100  # the fast path really ran
    assert _state(fast, fast_items) == _state(slow, slow_items)
    # the small cache preempted requests: fast-forward left those stretches to the step loop
    if num_gpu_blocks == 40:
        assert slow.counters.num_preemptions > 0


def test_fast_forward_refuses_while_prefill_is_pending() -> None:
    engine = _engine(400)
    engine.add_request(EngineRequest("a", list(range(1000, 1100)), 10), 0.0)
    assert engine.fast_forward_decode(0.0, 10.0) == (0.0, 0)
    step = engine.schedule(0.0)
    engine.finish_step(step, step.end_time)  # a 64-token chunk: still prefilling
    assert engine.fast_forward_decode(step.end_time, 10.0) == (step.end_time, 0)


def _decoding_batch() -> tuple[Engine, float]:
    """An engine whose full batch (6 requests) has just been prefilled, and the time."""
    engine = _engine(400)
    for index in range(6):
        start = 1000 + 10 * index
        engine.add_request(EngineRequest(f"r{index}", list(range(start, start + 8)), 50), 0.0)
    step = engine.schedule(0.0)
    engine.finish_step(step, step.end_time)
    return engine, step.end_time


def test_fast_forward_leaves_a_pending_intake_to_the_step_loop() -> None:
    engine, now = _decoding_batch()
    engine.add_request(EngineRequest("late", list(range(3000, 3008)), 5), now)
    # "late" waits for a seat, but its intake is due in the next step: nothing may skip past it.
    assert engine.fast_forward_decode(now, 10.0) == (now, 0)
    taking_in = engine.schedule(now)
    engine.finish_step(taking_in, taking_in.end_time)
    plain, _ = _decoding_batch()
    assert taking_in.duration == pytest.approx(plain.schedule(now).duration + COST.intake.time(8))
    assert engine.fast_forward_decode(taking_in.end_time, 10.0)[1] > 0
