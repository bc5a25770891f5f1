"""Each endpoint's measured slowness (``epp.load.endpoint_speed``), the producer that learns it from
completed requests, and the token-load cost that counts in time with it."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.load import endpoint_speed
from epp.load.endpoint_speed import BATCH_BINS, DecodeConditions, DecodeCounts, EndpointSpeeds
from epp.load.token_load import EndpointLoad
from epp.plugins.endpoint_speed import EndpointSpeedParameters, EndpointSpeedProducer
from epp.plugins.token_load_scorer import TokenLoadScorer, TokenLoadScorerParameters
from epp.scheduling.cycle_data import ENDPOINT_SPEED, PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import FakeClock, endpoint_state, make_request, routed_request


def step_s(batch: int) -> float:
    """A typical engine's decode step at ``batch`` requests: longer as the batch grows."""
    return 0.006 * (1 + math.log2(batch) / 2)


def at(batch: float, prefill_per_step: float = 0.0) -> DecodeConditions:
    return DecodeConditions(batch, prefill_per_step)


def test_conditions_are_binned_in_powers_of_two() -> None:
    batches = [at(n).bin()[0] for n in (0, 1, 2, 3, 4, 7, 8, 127, 128, 10_000)]
    assert batches == [0, 0, 1, 1, 2, 2, 3, 6, 7, 7]
    prefill = [at(1, tokens).bin()[1] for tokens in (0, 31.9, 32, 63, 64, 1000, 2047, 2048, 1e6)]
    assert prefill == [0, 0, 1, 1, 2, 5, 6, 7, 7]


def test_decode_counts_give_the_mean_batch_and_the_prompt_tokens_prefilled_per_step() -> None:
    counts = DecodeCounts()
    counts.sample("e", 0.0, requests=2)
    counts.prefilled("e", 0.5, 4000)  # before the decode: not beside it
    mark = counts.mark("e", 1.0)
    counts.sample("e", 2.0, requests=4)  # levels hold until the next sample
    counts.prefilled("e", 3.0, 1000)
    counts.sample("e", 4.0, requests=1)
    counts.prefilled("e", 4.5, 600)
    # 1..2: 2 requests; 2..4: 4; 4..5: 1. 1,600 tokens prefilled over 40 steps.
    assert counts.since("e", mark, 5.0, steps=40) == pytest.approx(at((2 + 8 + 1) / 4, 40.0))
    assert counts.since("e", mark, 1.0, steps=40) is None
    assert counts.since("e", mark, 5.0, steps=0) is None
    assert counts.since("unseen", counts.mark("unseen", 0.0), 3.0, steps=1) == at(0.0, 0.0)


def test_a_slow_endpoint_is_told_apart_from_a_busy_one() -> None:
    """The fast endpoints decode big batches, the slow ones (2.5x) small ones, so their raw TPOTs
    are close; compared under the same batch and prefill the slow ones read 2.5 times slower."""
    speeds = EndpointSpeeds(half_life=5)
    rng = random.Random(1)
    for _ in range(400):
        endpoint = rng.choice(["fast-0", "fast-1", "slow-0", "slow-1"])
        batch = rng.choice([4, 8, 16, 32] if endpoint.startswith("fast") else [1, 2, 4])
        prefill = rng.choice([0.0, 512.0])
        slowness = 2.5 if endpoint.startswith("slow") else 1.0
        speeds.observe(endpoint, at(batch, prefill), step_s(batch) * (1 + prefill / 256) * slowness)
    assert speeds.measured_slowness("slow-0") / speeds.measured_slowness("fast-0") == pytest.approx(
        2.5, rel=0.01
    )
    assert speeds.measured_slowness("slow-1") / speeds.measured_slowness("fast-1") == pytest.approx(
        2.5, rel=0.01
    )
    assert speeds.measured_slowness("fast-0") * speeds.measured_slowness("slow-0") == pytest.approx(
        1.0, rel=0.01
    )
    assert speeds.measured_slowness("unmeasured") == speeds.slowness("unmeasured") == 1.0


def test_slowness_is_reported_in_steps_of_ten_percent() -> None:
    """Endpoints 3% apart (noise, in a homogeneous pool) both read exactly 1; a 2.5x slower one
    reads within 5% of its measure."""
    speeds = EndpointSpeeds(half_life=2, refit_every=1)
    for _ in range(20):
        speeds.observe("a", at(1), 0.0100)
        speeds.observe("b", at(1), 0.0103)
    assert speeds.measured_slowness("b") > speeds.measured_slowness("a")
    assert speeds.slowness("a") == speeds.slowness("b") == 1.0
    for _ in range(40):
        speeds.observe("slow", at(1), 0.025)
    assert speeds.slowness("slow") == pytest.approx(speeds.measured_slowness("slow"), rel=0.05)


@settings(max_examples=60, deadline=None)
@given(
    truth=st.lists(st.floats(0.3, 3.0), min_size=1, max_size=6),
    bins=st.lists(st.integers(0, BATCH_BINS - 1), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_noise_free_step_times_give_each_endpoints_exact_relative_speed(
    truth: list[float], bins: list[int], seed: int
) -> None:
    """Reference model: log TPOT = log slowness + log step(batch), exactly. Whatever batches each
    endpoint happens to see (all share batch 1 at least once, so they can be compared), the
    estimate's ratios are the true ones."""
    rng = random.Random(seed)
    speeds = EndpointSpeeds(half_life=3)
    names = [f"e{i}" for i in range(len(truth))]
    for name, slowness in zip(names, truth, strict=True):
        speeds.observe(name, at(1), step_s(1) * slowness)
    for _ in range(300):
        i = rng.randrange(len(truth))
        batch = 2 ** rng.choice(bins)
        speeds.observe(names[i], at(batch), step_s(batch) * truth[i])
    first = speeds.measured_slowness(names[0])
    for name, slowness in zip(names, truth, strict=True):
        assert speeds.measured_slowness(name) / first == pytest.approx(slowness / truth[0], rel=1e-3)


def test_a_change_of_speed_is_followed_at_the_half_life() -> None:
    speeds = EndpointSpeeds(half_life=4, refit_every=1)
    for _ in range(40):
        speeds.observe("a", at(8), 0.01)
        speeds.observe("b", at(8), 0.01)
    assert speeds.measured_slowness("b") == pytest.approx(1.0)
    for _ in range(4):  # b's engine is now 4x slower: after one half-life, half way (in logs)
        speeds.observe("a", at(8), 0.01)
        speeds.observe("b", at(8), 0.04)
    assert speeds.measured_slowness("b") / speeds.measured_slowness("a") == pytest.approx(2.0, rel=0.01)
    for _ in range(60):
        speeds.observe("a", at(8), 0.01)
        speeds.observe("b", at(8), 0.04)
    assert speeds.measured_slowness("b") / speeds.measured_slowness("a") == pytest.approx(4.0, rel=0.01)


def test_unmeasurable_samples_teach_nothing_and_bad_settings_are_refused() -> None:
    speeds = EndpointSpeeds()
    for bad in (0.0, -1.0, math.nan, math.inf):
        speeds.observe("a", at(1), bad)
    assert speeds.measured_slowness("a") == 1.0
    with pytest.raises(ValueError):
        EndpointSpeeds(half_life=0)
    with pytest.raises(ValueError):
        EndpointSpeeds(refit_every=0)


def test_an_endpoint_gone_quiet_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_speed, "FORGET_AFTER", 50)
    speeds = EndpointSpeeds(half_life=2, refit_every=1)
    speeds.observe("gone", at(1), 0.05)
    speeds.observe("a", at(1), 0.01)
    assert speeds.measured_slowness("gone") / speeds.measured_slowness("a") == pytest.approx(5.0)
    for _ in range(60):
        speeds.observe("a", at(1), 0.01)
        speeds.observe("b", at(1), 0.02)
    assert speeds.measured_slowness("gone") == 1.0  # forgotten: it no longer shapes the centre
    assert speeds.measured_slowness("b") / speeds.measured_slowness("a") == pytest.approx(2.0)
    assert speeds.measured_slowness("a") * speeds.measured_slowness("b") == pytest.approx(1.0)


def test_the_producer_learns_from_completed_requests_under_their_conditions(context: PluginContext) -> None:
    """e0 and e1 each decode one request at a time, 11 tokens, while another request's 1,000
    uncached prompt tokens (of 1,600, 600 cached there) are prefilled; e1's steps take 3 times as
    long. A cancelled stream's TPOT says nothing."""
    clock = context.clock
    assert isinstance(clock, FakeClock)
    plugin = EndpointSpeedProducer("s", EndpointSpeedParameters(halfLife=2), context)
    endpoints = [endpoint_state(i) for i in range(3)]
    long_prompt = make_request(list(range(1600)))

    def route() -> CycleState:
        state = CycleState()
        state.put(TOKEN_LOAD, {e.name: EndpointLoad(1) for e in endpoints[:2]})
        state.put(PREFIX_MATCH, PrefixMatch(100, {"e0": 38, "e1": 38}, block_size_tokens=16))
        plugin.produce(long_prompt, endpoints, state)
        return state

    def serve(index: int, tpot_s: float, completed: bool = True) -> None:
        endpoint = endpoints[index].endpoint
        result, state = SchedulingResult((endpoint,), "default"), CycleState()
        first_token = clock()
        plugin.on_first_token(routed_request(make_request([1]), result, state), first_token)
        beside = route()
        clock.advance(5 * tpot_s)
        plugin.on_first_token(routed_request(long_prompt, result, beside), clock())
        clock.advance(5 * tpot_s)
        outcome = RequestOutcome(endpoint, 0.0, clock(), 200, True, completed, first_token, 11)
        plugin.on_finished(routed_request(make_request([1]), result, state), outcome)

    route()
    for _ in range(10):
        serve(0, 0.01)
        serve(1, 0.03)
        serve(1, 1.0, completed=False)
    state = CycleState()
    plugin.produce(make_request([1]), endpoints, state)
    slowness = state.get(ENDPOINT_SPEED)
    assert slowness is not None and set(slowness) == {"e0", "e1", "e2"}
    assert slowness["e1"] / slowness["e0"] == pytest.approx(3.0, rel=0.1)  # each in 10% steps
    assert slowness["e2"] == 1.0


def test_the_token_load_cost_counts_in_time_with_measured_speeds(context: PluginContext) -> None:
    """A slow endpoint (2.5x) with 400 blocks booked costs what a fast one with 1,000 does."""
    scorer = TokenLoadScorer("t", TokenLoadScorerParameters(blockSizeTokens=16), context)
    endpoints = [endpoint_state(i) for i in range(3)]
    state = CycleState()
    state.put(TOKEN_LOAD, {"e0": EndpointLoad(kv_tokens=16_000), "e1": EndpointLoad(kv_tokens=6_400)})
    request = make_request([0] * 16)
    assert scorer.costs(request, endpoints, state) == [1001.0, 401.0, 1.0]
    state.put(ENDPOINT_SPEED, {"e0": 1.0, "e1": 2.5})  # e2 not measured: its cost stays in blocks
    assert scorer.costs(request, endpoints, state) == pytest.approx([1001.0, 1002.5, 1.0])
