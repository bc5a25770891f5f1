from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.load.output_length import ExpectedOutput, OutputSource, SessionOutputLengths
from epp.load.token_load import EndpointLoad
from epp.plugins.latency_scorer import LatencyScorer, LatencyScorerParameters
from epp.plugins.prefix_affinity_filter import PrefixAffinityParameters, PrefixCacheAffinityFilter
from epp.plugins.token_load import TokenLoadParameters, TokenLoadProducer
from epp.plugins.token_load_scorer import TokenLoadScorer, TokenLoadScorerParameters
from epp.scheduling.cycle_data import EXPECTED_OUTPUT, PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from epp.scheduling.predictions import LATENCY_PREDICTIONS, EndpointPrediction, LatencyPredictions
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import FakeClock, FakePredictor, endpoint_state, make_request, routed_request, run
from tests.epp.latency_fakes import producer as latency_producer


def reference_mean(answers: list[int], half_life: float) -> float:
    """The weighted mean written out: the newest answer weighs a, the one before a(1−a), ...,
    the first the weight left over, (1−a)^(n−1)."""
    a = 1 - 0.5 ** (1 / half_life)
    n = len(answers)
    total = (1 - a) ** (n - 1) * answers[0]
    for k in range(1, n):
        total += a * (1 - a) ** (n - 1 - k) * answers[k]
    return total


@given(
    turns=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 10_000)), min_size=1, max_size=30),
    half_life=st.floats(0.5, 20),
)
def test_session_and_pool_means_match_the_written_out_weighted_mean(turns, half_life) -> None:
    lengths = SessionOutputLengths(half_life=half_life)
    for session, tokens in turns:
        lengths.observe(session, tokens, now=0.0)
    for session in "abc":
        answers = [tokens for s, tokens in turns if s == session]
        got = lengths.session_mean(session, 0.0)
        assert (got is None) == (not answers)
        if answers:
            assert got == pytest.approx(reference_mean(answers, half_life))
            assert lengths.expected(session, 0.0) == ExpectedOutput(max(1, round(got)), OutputSource.SESSION)
    pool = lengths.expected("unseen", 0.0)
    assert pool is not None and pool.source is OutputSource.POOL
    assert pool.tokens == max(1, round(reference_mean([t for _, t in turns], half_life)))


def test_nothing_is_expected_before_any_answer_and_anonymous_turns_teach_only_the_pool() -> None:
    lengths = SessionOutputLengths()
    assert lengths.expected("a", 0.0) is None
    lengths.observe(None, 300, 0.0)
    assert len(lengths) == 0 and lengths.expected("a", 0.0) == ExpectedOutput(300, OutputSource.POOL)


def test_sessions_are_bounded_least_recently_answered_first_and_expire() -> None:
    lengths = SessionOutputLengths(capacity=2, ttl_s=10.0)
    lengths.observe("a", 100, 0.0)
    lengths.observe("b", 200, 1.0)
    lengths.observe("a", 100, 2.0)  # a is now the most recent
    lengths.observe("c", 300, 3.0)
    assert len(lengths) == 2 and lengths.session_mean("b", 3.0) is None
    assert lengths.session_mean("a", 3.0) == 100 and lengths.session_mean("c", 3.0) == 300
    assert lengths.session_mean("c", 13.0) == 300 and lengths.session_mean("c", 13.5) is None
    lengths.observe("c", 50, 20.0)  # an expired mean starts over
    assert lengths.session_mean("c", 20.0) == 50


def producer(**params: object) -> tuple[TokenLoadProducer, FakeClock]:
    clock = FakeClock()
    context = PluginContext(clock=clock, rng=random.Random(0))
    return TokenLoadProducer("t", TokenLoadParameters.model_validate(params), context), clock


def finish(p: TokenLoadProducer, request, state: CycleState, tokens: int, at: float) -> None:
    result = SchedulingResult((endpoint_state(0).endpoint,), "p")
    outcome = RequestOutcome(result.endpoint, at - 1, at, 200, True, True, at - 0.5, tokens)
    p.on_finished(routed_request(request, result, state), outcome)


def test_the_hint_comes_first_then_the_session_then_the_pool_then_max_tokens() -> None:
    p, clock = producer(learnSessionOutput=True, sessionHeader="x-conversation")
    turn = make_request(list(range(10)))
    turn.headers = {"x-conversation": "s1"}
    turn.max_tokens = 4000
    assert p.expected_output(turn) == ExpectedOutput(4000, OutputSource.DEFAULT)
    finish(p, turn, CycleState(), 120, clock())
    other = make_request(list(range(10)))
    other.headers = {"x-conversation": "s2"}
    assert p.expected_output(turn) == ExpectedOutput(120, OutputSource.SESSION)
    assert p.expected_output(other) == ExpectedOutput(120, OutputSource.POOL)
    turn.expected_output_tokens = 7
    assert p.expected_output(turn) == ExpectedOutput(7, OutputSource.HINT)


def test_without_learning_finished_turns_teach_nothing() -> None:
    p, clock = producer()
    turn = make_request(list(range(10)))
    turn.headers = {"x-session-id": "s1"}
    finish(p, turn, CycleState(), 120, clock())
    assert p.sessions is None and p.expected_output(turn) == ExpectedOutput(15, OutputSource.DEFAULT)


def test_the_booking_carries_the_expected_output() -> None:
    p, _ = producer()
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))
    request.max_tokens = 8192
    request.expected_output_tokens = 300
    state = CycleState()
    p.produce(request, endpoints, state)
    assert state.get(EXPECTED_OUTPUT) == ExpectedOutput(300, OutputSource.HINT)
    p.pre_request(request, SchedulingResult((endpoints[1].endpoint,), "p"), state)
    assert p.tracker.load("e1").expected_remaining_tokens == 300
    assert p.tracker.terms(state.key).expected_output == 300  # type: ignore[union-attr]


def test_the_token_load_cost_counts_the_expected_remaining_output_when_weighted() -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(0))
    endpoints = [endpoint_state(0), endpoint_state(1)]
    state = CycleState()
    # Same blocks held now; e0's requests are expected to decode 8,000 more tokens, e1's 800.
    state.put(
        TOKEN_LOAD, {"e0": EndpointLoad(2, 0, 1600, 8000, 1600), "e1": EndpointLoad(2, 0, 1600, 800, 1600)}
    )
    request = make_request(list(range(160)))
    weighted = TokenLoadScorer("t", TokenLoadScorerParameters(expectedOutputWeight=0.5), context)
    # (160 + 1600 + 0.5·8000)/16 = 360 and (160 + 1600 + 0.5·800)/16 = 135
    assert weighted.costs(request, endpoints, state) == [360.0, 135.0]
    off = TokenLoadScorer("t", TokenLoadScorerParameters(), context)
    assert off.costs(request, endpoints, state) == [110.0, 110.0]


def latency_scores(expected: ExpectedOutput | None, weigh_from: int | None = 2) -> list[float]:
    """e0 answers first sooner (TTFT 100 ms) but decodes at 20 ms a token, e1 at 400 ms and 10 ms."""
    scorer = LatencyScorer("s", LatencyScorerParameters(weighByExpectedOutputFrom=weigh_from), PluginContext(
        clock=FakeClock(), rng=random.Random(0)))  # fmt: skip
    state = CycleState()
    by = {
        "e0": EndpointPrediction(100.0, 20.0, -100.0, None),
        "e1": EndpointPrediction(400.0, 10.0, -400.0, None),
    }
    state.put(LATENCY_PREDICTIONS, LatencyPredictions(by, None, None, tpot_applies=True))
    if expected is not None:
        state.put(EXPECTED_OUTPUT, expected)
    return scorer.score(make_request([1]), [endpoint_state(0), endpoint_state(1)], state)


def test_the_latency_scorer_weighs_ttft_and_tpot_by_the_expected_answers_predicted_e2e() -> None:
    # Predicted E2E for 2 tokens: 120 ms on e0 against 410; for 1,000: 20,080 ms against 10,390.
    short = latency_scores(ExpectedOutput(2, OutputSource.HINT))
    long = latency_scores(ExpectedOutput(1000, OutputSource.SESSION))
    assert short[0] > short[1] and long[1] > long[0]
    # Without an estimate, under the threshold or with the weighting off, the configured 0.8/0.2
    # blend: TTFT wins.
    for unweighted in (
        latency_scores(None),
        latency_scores(ExpectedOutput(1000, OutputSource.DEFAULT)),
        latency_scores(ExpectedOutput(1000, OutputSource.HINT), weigh_from=1001),
        latency_scores(ExpectedOutput(1000, OutputSource.HINT), weigh_from=None),
    ):
        assert unweighted[0] > unweighted[1]


def test_a_long_answer_cached_where_there_is_no_queue_is_still_predicted() -> None:
    fake = FakePredictor()
    plugin = latency_producer(fake, skipWhenCachedAt=0.8, predictOutputsFrom=2048)

    def predicted(expected: ExpectedOutput | None) -> bool:
        state = CycleState()
        state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 9}))
        if expected is not None:
            state.put(EXPECTED_OUTPUT, expected)
        pending = plugin.produce(make_request(list(range(50))), [endpoint_state(0), endpoint_state(1)], state)
        if pending is not None:
            run(pending)
        return state.get(LATENCY_PREDICTIONS) is not None

    assert predicted(ExpectedOutput(2048, OutputSource.HINT))
    assert predicted(ExpectedOutput(5000, OutputSource.SESSION))
    assert not predicted(ExpectedOutput(2047, OutputSource.HINT))
    assert not predicted(ExpectedOutput(8192, OutputSource.DEFAULT))  # max_tokens is no estimate
    assert not predicted(None)


def test_the_affinity_gate_judges_a_long_answer_by_its_predicted_e2e() -> None:
    # The prompt is cached on e0, which decodes at 15 ms a token; e1 would re-prefill it (TTFT
    # 1.5 s more) and decode at 6 ms.
    endpoints = [endpoint_state(0), endpoint_state(1)]
    by = {"e0": EndpointPrediction(100.0, 15.0, 0.0, None), "e1": EndpointPrediction(1600.0, 6.0, 0.0, None)}
    gate = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(gateOnExpectedOutput=True), PluginContext(
        clock=FakeClock(), rng=random.Random(0)))  # fmt: skip

    def kept(expected: ExpectedOutput | None) -> list[str]:
        state = CycleState()
        state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 9}))
        state.put(LATENCY_PREDICTIONS, LatencyPredictions(by, None, None, tpot_applies=True))
        if expected is not None:
            state.put(EXPECTED_OUTPUT, expected)
        return [e.name for e in gate.filter(make_request([1]), endpoints, state)]

    # 8,000 tokens: 100 + 7,999·15 = 120,085 ms against 1,600 + 7,999·6 = 49,594: 70 s saved.
    assert kept(ExpectedOutput(8000, OutputSource.HINT)) == ["e0", "e1"]
    # 500 tokens: 7,585 against 4,594 ms, under the 5 s penalty: stays cached.
    assert kept(ExpectedOutput(500, OutputSource.HINT)) == ["e0"]
    assert kept(ExpectedOutput(8000, OutputSource.DEFAULT)) == ["e0"]  # TTFT alone: 1.5 s worse
    assert kept(None) == ["e0"]
