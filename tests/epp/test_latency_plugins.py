"""Predicted-latency plugins with an in-process fake predictor."""

from __future__ import annotations

import dataclasses
import random

import pytest

from epp.configs import config_path
from epp.errors import RequestShed
from epp.load.token_load import EndpointLoad
from epp.plugins.latency_scorer import (
    LatencyScorer,
    LatencyScorerParameters,
    composite_heuristic,
    prefill_work_scores,
)
from epp.plugins.latency_slo_admitter import LatencySloAdmitter, LatencySloAdmitterParameters
from epp.plugins.prefix_affinity_filter import PrefixAffinityParameters, PrefixCacheAffinityFilter
from epp.plugins.slo_headroom_tier_filter import SloHeadroomTierFilter, SloHeadroomTierParameters
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.cycle_data import ENDPOINT_SPEED, PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from epp.scheduling.predictions import (
    FEATURE_ROWS,
    LATENCY_PREDICTIONS,
    PREDICTION_FALLBACK,
    EndpointPrediction,
    LatencyPredictions,
)
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import FakeClock, FakePredictor, endpoint_state, make_request, routed_request, run
from tests.epp.latency_fakes import produce, producer, streaming_request
from wire.latency import FeatureRow, endpoint_class_code


def test_producer_predicts_every_candidate_in_one_call_with_headroom() -> None:
    fake = FakePredictor()
    plugin = producer(fake, streamingMode=True)
    endpoints = [endpoint_state(0, waiting=0, running=2), endpoint_state(1, waiting=3, running=0)]
    state = produce(plugin, streaming_request(slo_ttft_ms=250.0, slo_tpot_ms=12.0), endpoints)
    assert len(fake.calls) == 1 and len(fake.calls[0]) == 2
    assert fake.calls[0][1]["num_request_waiting"] == 3 and fake.calls[0][0]["input_token_length"] == 50
    by = state.get(LATENCY_PREDICTIONS).by_endpoint
    assert by["e0"] == EndpointPrediction(100.0, 20.0, 150.0, -8.0)
    assert by["e1"] == EndpointPrediction(400.0, 10.0, -150.0, 2.0)
    assert not by["e0"].meets_slo and not by["e1"].meets_slo


def test_feature_rows_carry_each_candidates_tokens_in_flight() -> None:
    fake = FakePredictor()
    plugin = producer(fake)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    state = CycleState()
    state.put(TOKEN_LOAD, {"e1": EndpointLoad(2, 300, 700, 40, 1000)})
    run(plugin.produce(make_request(list(range(50))), endpoints, state))
    e0, e1 = fake.calls[0]
    assert (e0["prefill_tokens_in_flight"], e0["decode_tokens_in_flight"]) == (0, 0)
    assert (e1["prefill_tokens_in_flight"], e1["decode_tokens_in_flight"]) == (300, 700)
    FeatureRow.model_validate(e1)  # the trainer's schema accepts the row as is


def test_feature_rows_carry_each_endpoints_class_from_the_named_label() -> None:
    fake = FakePredictor()
    plugin = producer(fake, endpointClassLabel="accelerator")
    fast, slow, unlabeled = endpoint_state(0), endpoint_state(1), endpoint_state(2)
    endpoints = [
        dataclasses.replace(
            fast, endpoint=dataclasses.replace(fast.endpoint, labels={"accelerator": "h100"})
        ),
        dataclasses.replace(slow, endpoint=dataclasses.replace(slow.endpoint, labels={"accelerator": "l4"})),
        unlabeled,
    ]
    run(plugin.produce(make_request(list(range(50))), endpoints, CycleState()))
    classes = [row["endpoint_class"] for row in fake.calls[0]]
    assert classes == [endpoint_class_code("h100"), endpoint_class_code("l4"), 0]
    assert len(set(classes)) == 3
    FeatureRow.model_validate(fake.calls[0][1])
    run(producer(fake).produce(make_request(list(range(50))), endpoints, CycleState()))
    assert [row["endpoint_class"] for row in fake.calls[1]] == [0, 0, 0]  # no label named: class 0


def test_a_prompt_cached_where_there_is_no_queue_is_not_predicted() -> None:
    fake = FakePredictor()
    plugin = producer(fake, skipWhenCachedAt=0.8)

    def produce_with(waiting: int, matched_blocks: int) -> CycleState:
        state = CycleState()
        state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": matched_blocks}))
        endpoints = [endpoint_state(0, waiting=waiting), endpoint_state(1)]
        pending = plugin.produce(make_request(list(range(50))), endpoints, state)
        if pending is not None:
            run(pending)
        return state

    cached = produce_with(waiting=0, matched_blocks=9)
    assert fake.calls == [] and cached.get(PREDICTION_FALLBACK) == "cached"
    assert cached.get(LATENCY_PREDICTIONS) is None
    assert cached.get(FEATURE_ROWS)["e0"]["prefix_cache_score"] == 0.9  # still trains the model
    queued = produce_with(waiting=2, matched_blocks=9)  # the affinity gate may need the predictions
    assert len(fake.calls) == 1 and queued.get(LATENCY_PREDICTIONS) is not None
    partly = produce_with(waiting=0, matched_blocks=5)
    assert len(fake.calls) == 2 and partly.get(PREDICTION_FALLBACK) is None
    default = produce(producer(fake), make_request(list(range(50))), [endpoint_state(0)])
    assert len(fake.calls) == 3 and default.get(LATENCY_PREDICTIONS) is not None


def test_no_slo_means_negative_headroom_and_tpot_only_binds_for_streaming() -> None:
    plugin = producer(FakePredictor(), streamingMode=True)
    request = make_request([1, 2, 3])  # not streaming
    by = produce(plugin, request, [endpoint_state(0)]).get(LATENCY_PREDICTIONS).by_endpoint
    assert by["e0"].ttft_headroom_ms == -100.0 and by["e0"].tpot_headroom_ms is None


def test_tightest_running_tpot_slo_binds() -> None:
    plugin = producer(FakePredictor(), streamingMode=True)
    endpoints = [endpoint_state(0)]
    tight = streaming_request(slo_tpot_ms=5.0, request_id="tight")
    state = produce(plugin, tight, endpoints)
    plugin.pre_request(tight, SchedulingResult((endpoints[0].endpoint,), "p"), state)
    loose = streaming_request(slo_tpot_ms=50.0, request_id="loose")
    assert (
        produce(plugin, loose, endpoints).get(LATENCY_PREDICTIONS).by_endpoint["e0"].tpot_headroom_ms == -5.0
    )
    plugin.on_finished(
        routed_request(tight, SchedulingResult((endpoints[0].endpoint,), "p"), state),
        outcome(completed=False),
    )
    assert (
        produce(plugin, loose, endpoints).get(LATENCY_PREDICTIONS).by_endpoint["e0"].tpot_headroom_ms == 40.0
    )


def test_running_tpot_slos_of_requests_sharing_a_client_request_id_are_kept_apart() -> None:
    plugin = producer(FakePredictor(), streamingMode=True)
    endpoints = [endpoint_state(0)]
    target = SchedulingResult((endpoints[0].endpoint,), "p")
    first, retry = (streaming_request(slo_tpot_ms=5.0, request_id="same") for _ in range(2))
    first_state, retry_state = produce(plugin, first, endpoints), produce(plugin, retry, endpoints)
    plugin.pre_request(first, target, first_state)
    plugin.pre_request(retry, target, retry_state)
    plugin.on_finished(routed_request(first, target, first_state), outcome(completed=False))
    probe = streaming_request(slo_tpot_ms=50.0, request_id="probe")
    # The retry still runs there, so its 5 ms SLO still binds.
    assert (
        produce(plugin, probe, endpoints).get(LATENCY_PREDICTIONS).by_endpoint["e0"].tpot_headroom_ms == -5.0
    )


@pytest.mark.parametrize(
    ("fail", "opt_in", "reason"), [("timeout", None, "timeout"), (None, False, "disabled")]
)
def test_fallback_writes_only_the_reason_and_features(
    fail: str | None, opt_in: bool | None, reason: str
) -> None:
    fake = FakePredictor(fail=fail)
    request = streaming_request(prediction_based=opt_in)
    state = produce(producer(fake), request, [endpoint_state(0)])
    assert state.get(LATENCY_PREDICTIONS) is None and state.get(PREDICTION_FALLBACK) == reason
    assert state.get(FEATURE_ROWS)["e0"]["input_token_length"] == 50
    assert (len(fake.calls) == 0) is (opt_in is False)


def outcome(*, completed: bool = True, streaming: bool = True, tokens: int = 11) -> RequestOutcome:
    e = endpoint_state(0).endpoint
    return RequestOutcome(e, received_at=10.0, finished_at=12.0, status=200, streaming=streaming,
                          completed=completed, first_token_at=10.5, completion_tokens=tokens)  # fmt: skip


def test_training_samples_from_the_chosen_endpoint_row() -> None:
    fake = FakePredictor()
    plugin = producer(fake, streamingMode=True)
    endpoints = [endpoint_state(0, waiting=1), endpoint_state(1)]
    request = streaming_request()
    state = produce(plugin, request, endpoints)
    plugin.on_finished(
        routed_request(request, SchedulingResult((endpoints[0].endpoint,), "p"), state), outcome()
    )
    ttft, tpot = fake.samples
    assert (
        ttft["num_request_waiting"] == 1 and ttft["actual_ttft_ms"] == 500.0 and ttft["actual_tpot_ms"] == 0.0
    )
    assert tpot["actual_tpot_ms"] == pytest.approx(150.0) and tpot["actual_ttft_ms"] == 0.0
    assert ttft["timestamp"] == 1.7e9
    # Failed requests teach nothing; non-streaming mode trains on end-to-end latency.
    plugin.on_finished(
        routed_request(request, SchedulingResult((endpoints[0].endpoint,), "p"), state),
        outcome(completed=False),
    )
    assert len(fake.samples) == 2
    e2e = producer(FakePredictor(), streamingMode=False)
    e2e_state = produce(e2e, request, endpoints)
    e2e.on_finished(
        routed_request(request, SchedulingResult((endpoints[0].endpoint,), "p"), e2e_state),
        outcome(streaming=False),
    )
    assert [s["actual_ttft_ms"] for s in e2e.predictor.samples] == [2000.0]


def context() -> PluginContext:
    return PluginContext(clock=FakeClock(), rng=random.Random(3))


def state_with(predictions: dict[str, EndpointPrediction] | None, match: dict[str, int] | None = None,
               slo: float | None = 300.0) -> CycleState:  # fmt: skip
    state = CycleState()
    if predictions is not None:
        state.put(LATENCY_PREDICTIONS, LatencyPredictions(predictions, slo, None))
    if match is not None:
        state.put(PREFIX_MATCH, PrefixMatch(10, match))
    return state


def p(ttft: float, ttft_h: float, tpot: float = 10.0, tpot_h: float | None = None) -> EndpointPrediction:
    return EndpointPrediction(ttft, tpot, ttft_h, tpot_h)


def test_affinity_filter_sticks_unless_exploring_or_gated() -> None:
    f = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(), context())
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request([])
    assert f.filter(request, endpoints, state_with(None, {"e0": 9})) == [endpoints[0]]
    assert f.filter(request, endpoints, state_with(None, {"e0": 5})) == endpoints  # 0.5 < 0.8: nobody sticky
    gated = state_with({"e0": p(9000, 0), "e1": p(100, 0)}, {"e0": 9})
    assert f.filter(request, endpoints, gated) == endpoints  # sticky is 8.9 s slower: gate opens
    ok = state_with({"e0": p(3000, 0), "e1": p(100, 0)}, {"e0": 9})
    assert f.filter(request, endpoints, ok) == [endpoints[0]]
    explorer = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(explorationProbability=1.0), context())
    assert explorer.filter(request, endpoints, state_with(None, {"e0": 9})) == endpoints


def loaded_state(
    loads: dict[str, EndpointLoad], match: dict[str, int], slowness: dict[str, float] | None = None
) -> CycleState:
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(10, match, block_size_tokens=10))
    state.put(TOKEN_LOAD, loads)
    if slowness is not None:
        state.put(ENDPOINT_SPEED, slowness)
    return state


def test_without_predictions_the_load_gate_drops_affinity_when_staying_costs_more() -> None:
    gated = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(maxLoadPenaltyTokens=0), context())
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))  # 9 of 10 blocks cached on e0: 10 tokens to prefill there
    busy_home = {"e0": EndpointLoad(requests=1, prefill_tokens=60, kv_tokens=60)}
    # Staying: 60 booked + 10 + 60 KV = 130 tokens; moving: 100 to prefill on e1.
    assert gated.filter(request, endpoints, loaded_state(busy_home, {"e0": 9})) == endpoints
    light_home = {"e0": EndpointLoad(requests=1, prefill_tokens=40, kv_tokens=40)}  # 90 against 100
    assert gated.filter(request, endpoints, loaded_state(light_home, {"e0": 9})) == [endpoints[0]]
    margin = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(maxLoadPenaltyTokens=30), context())
    assert margin.filter(request, endpoints, loaded_state(busy_home, {"e0": 9})) == [endpoints[0]]
    off = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(), context())
    assert off.filter(request, endpoints, loaded_state(busy_home, {"e0": 9})) == [endpoints[0]]
    # No token load to judge by: the gate stays shut.
    assert gated.filter(request, endpoints, state_with(None, {"e0": 9})) == [endpoints[0]]


def test_on_synced_replicas_with_live_peers_the_load_gate_stays_shut() -> None:
    gated = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(maxLoadPenaltyTokens=0), context())
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))
    busy_home = loaded_state({"e0": EndpointLoad(requests=1, prefill_tokens=60, kv_tokens=60)}, {"e0": 9})
    peers = [0]
    gated.join_replicas(lambda: peers[0])
    assert gated.filter(request, endpoints, busy_home) == endpoints  # no live peer: 130 against 100
    peers[0] = 2  # the peers' picks of a moment ago are not in this token load
    assert gated.filter(request, endpoints, busy_home) == [endpoints[0]]


def test_the_load_gate_counts_time_where_speeds_are_measured_and_yields_to_predictions() -> None:
    gated = PrefixCacheAffinityFilter("a", PrefixAffinityParameters(maxLoadPenaltyTokens=0), context())
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))
    light_home = {"e0": EndpointLoad(requests=1, prefill_tokens=40, kv_tokens=40)}
    # 90 tokens at home against 100 on e1, but e1 is twice as slow: 90 against 200.
    slow_other = loaded_state(light_home, {"e0": 9}, {"e1": 2.0})
    assert gated.filter(request, endpoints, slow_other) == [endpoints[0]]
    slow_home = loaded_state(light_home, {"e0": 9}, {"e0": 2.0})
    assert gated.filter(request, endpoints, slow_home) == endpoints  # 180 against 100
    busy_home = {"e0": EndpointLoad(requests=1, prefill_tokens=60, kv_tokens=60)}
    predicted = loaded_state(busy_home, {"e0": 9})
    predicted.put(LATENCY_PREDICTIONS, LatencyPredictions({"e0": p(90, 0), "e1": p(100, 0)}, None, None))
    assert gated.filter(request, endpoints, predicted) == [endpoints[0]]  # the TTFT gate judges


def test_tier_filter_prefers_endpoints_meeting_the_slo() -> None:
    endpoints = [endpoint_state(0), endpoint_state(1), endpoint_state(2)]
    preds = {"e0": p(100, 200), "e1": p(500, -200), "e2": p(250, 50)}
    f = SloHeadroomTierFilter("t", SloHeadroomTierParameters(epsilonExploreNeg=0.0), context())
    assert f.filter(make_request([]), endpoints, state_with(preds)) == [endpoints[0], endpoints[2]]
    explore = SloHeadroomTierFilter("t", SloHeadroomTierParameters(epsilonExploreNeg=1.0), context())
    assert explore.filter(make_request([]), endpoints, state_with(preds)) == [endpoints[1]]
    assert f.filter(make_request([]), endpoints, state_with(None)) == endpoints


def scorer(strategy: str = "least") -> LatencyScorer:
    return LatencyScorer("s", LatencyScorerParameters(headroomSelectionStrategy=strategy), context())


def test_scorer_best_fit_or_most_slack_among_endpoints_meeting_the_slo() -> None:
    endpoints = [endpoint_state(0, running=1), endpoint_state(1, running=1), endpoint_state(2, running=1)]
    preds = {"e0": p(100, 200), "e1": p(250, 50), "e2": p(500, -200)}
    least = scorer("least").score(make_request([]), endpoints, state_with(preds))
    most = scorer("most").score(make_request([]), endpoints, state_with(preds))
    assert least[1] > least[0] > least[2] == 0.0
    assert most[0] > most[1] > most[2] == 0.0


def test_scorer_without_slo_prefers_the_lowest_prediction() -> None:
    endpoints = [endpoint_state(0), endpoint_state(1)]
    scores = scorer().score(
        make_request([]), endpoints, state_with({"e0": p(400, -400), "e1": p(100, -100)}, slo=None)
    )
    assert scores[1] > scores[0] > 0


def test_scorer_does_not_blow_small_differences_up_to_the_full_range() -> None:
    endpoints = [endpoint_state(0, running=1), endpoint_state(1, running=1)]
    near = scorer("most").score(
        make_request([]), endpoints, state_with({"e0": p(50, 2950), "e1": p(52, 2948)})
    )
    assert near[0] > near[1] and near[0] - near[1] < 0.05  # 2 ms of 50: nearly a tie
    far = scorer("most").score(
        make_request([]), endpoints, state_with({"e0": p(50, 2950), "e1": p(300, 2700)})
    )
    assert far == pytest.approx([1.0, 0.1])  # a difference five times the best prediction: the full range
    no_slo = scorer().score(
        make_request([]), endpoints, state_with({"e0": p(100, -100), "e1": p(105, -105)}, slo=None)
    )
    assert 0 < no_slo[0] - no_slo[1] < 0.05


def test_scorer_when_nobody_meets_the_slo_idle_then_smallest_deficit() -> None:
    busy = [endpoint_state(i, running=2) for i in range(3)]
    preds = {"e0": p(900, -600), "e1": p(400, -100), "e2": p(200, 10, tpot_h=-5)}
    scores = scorer().score(make_request([]), busy, state_with(preds))
    assert scores[2] > scores[1] > scores[0]  # TPOT-only deficit, then the smaller TTFT deficit
    with_idle = [endpoint_state(0, running=2), endpoint_state(1), endpoint_state(2, running=2)]
    idle_scores = scorer().score(make_request([]), with_idle, state_with(preds))
    assert idle_scores.index(max(idle_scores)) == 1


def test_scorer_falls_back_to_the_composite_heuristic() -> None:
    endpoints = [endpoint_state(0, waiting=4, kv=0.5), endpoint_state(1, waiting=0, kv=0.1)]
    state = state_with(None, {"e0": 10})
    scores = scorer().score(make_request([]), endpoints, state)
    # queue 2, free KV 2, prefix 3: the cached endpoint wins despite its queue
    assert (
        scores
        == composite_heuristic(endpoints, state)
        == pytest.approx([(2 * 0 + 2 * 0.5 + 3 * 1) / 7, (2 * 1 + 2 * 0.9 + 3 * 0) / 7])
    )


def test_with_the_token_load_the_fallback_also_weighs_the_prefill_work_ahead() -> None:
    endpoints = [endpoint_state(0), endpoint_state(1)]  # the scraped metrics have not seen anything yet
    request = make_request(list(range(1000)))

    def scores(prefill_in_flight: int) -> list[float]:
        state = state_with(None)
        state.put(TOKEN_LOAD, {"e0": EndpointLoad(requests=1, prefill_tokens=prefill_in_flight)})
        return scorer().score(request, endpoints, state)

    long_prefill = scores(16_000)
    assert long_prefill[1] - long_prefill[0] > 0.4  # 17k tokens of prefill to wait for and do, against 1k
    few_tokens = scores(200)
    assert 0 < few_tokens[1] - few_tokens[0] < 0.05  # a few hundred tokens: about a tie


def test_with_measured_speeds_the_fallback_weighs_prefill_work_in_time() -> None:
    """Without speeds a 1k-token prompt ties on two empty endpoints; with e1 measured 2.5 times
    slower, its work takes 2.5 times as long and it scores 1/2.5 of e0 on that half."""
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(1000)))
    state = state_with(None)
    state.put(TOKEN_LOAD, {})
    assert prefill_work_scores(request, endpoints, state) == [1.0, 1.0]
    state.put(ENDPOINT_SPEED, {"e0": 0.8, "e1": 2.0})
    assert prefill_work_scores(request, endpoints, state) == pytest.approx([1.0, 0.4])
    state.put(TOKEN_LOAD, {"e0": EndpointLoad(requests=2, prefill_tokens=6_000)})
    # e0: (6,000 + 1,000 + 1,024) · 0.8 = 6,419;  e1: (1,000 + 1,024) · 2 = 4,048
    assert prefill_work_scores(request, endpoints, state) == pytest.approx([4048 / 6419.2, 1.0])


def test_the_fallback_ranks_endpoints_as_the_gie_default_profile_does() -> None:
    gie = build_pipeline(EndpointPickerConfig.from_file(config_path("gie-default")), context()).profile
    rng = random.Random(7)
    for _ in range(50):
        endpoints = [
            endpoint_state(i, waiting=rng.randrange(6), kv=rng.random(), running=rng.randrange(6))
            for i in range(4)
        ]
        state = state_with(None, {f"e{i}": rng.randrange(11) for i in range(4)})
        totals = gie.run(make_request([]), endpoints, state).scores
        assert composite_heuristic(endpoints, state) == pytest.approx([totals[e.name] / 7 for e in endpoints])


def warming_up(config: str):
    """The shipped ``config``'s pipeline with predictors that have no model yet."""
    ctx = PluginContext(
        clock=FakeClock(), rng=random.Random(5), latency_predictor=FakePredictor("warming_up")
    )
    return build_pipeline(EndpointPickerConfig.from_file(config_path(config)), ctx)


def pick(
    pipeline, tokens: list[int], endpoints, request_id: str = "r", finish: bool = False
) -> tuple[str, CycleState]:
    """Route a request through ``pipeline``; with ``finish`` it also completes there at once."""
    state = CycleState()
    request = streaming_request(slo_ttft_ms=3000.0, slo_tpot_ms=50.0, request_id=request_id)
    request.prompt_token_ids = tokens
    result = run(pipeline.schedule(request, endpoints, state))
    if finish:
        done = dataclasses.replace(outcome(), endpoint=result.endpoint)
        for observer in pipeline.observers:
            observer.on_finished(routed_request(request, result, state), done)
    return result.endpoint.name, state


def test_warming_up_a_new_prompt_goes_to_the_least_loaded_endpoint() -> None:
    fleet = [
        endpoint_state(0, waiting=3, running=6, kv=0.7),
        endpoint_state(1, waiting=1, running=3, kv=0.4),
        endpoint_state(2, waiting=0, running=1, kv=0.1),
        endpoint_state(3, waiting=2, running=2, kv=0.2),
    ]
    for i in range(20):
        name, state = pick(
            warming_up("predicted-latency-token-load"), list(range(i * 1000, i * 1000 + 900)), fleet
        )
        assert state.get(PREDICTION_FALLBACK) == "warming_up"
        assert name == "e2"


def test_warming_up_equal_engines_are_told_apart_by_the_tokens_routed_to_them() -> None:
    pipeline = warming_up("predicted-latency-token-load")
    idle = [endpoint_state(i) for i in range(3)]
    first, _ = pick(pipeline, list(range(4000)), idle, "a")  # 4,000 tokens now in flight there
    second, _ = pick(pipeline, list(range(10_000, 10_500)), idle, "b")
    third, _ = pick(pipeline, list(range(20_000, 20_500)), idle, "c")
    assert (
        len({first, second, third}) == 3
    )  # the engines' metrics have not caught up; the EPP's own count has


def test_warming_up_a_follow_up_turn_stays_with_its_cache_on_a_busier_endpoint() -> None:
    pipeline = warming_up("predicted-latency-token-load")
    idle = [endpoint_state(i) for i in range(4)]
    home, _ = pick(pipeline, list(range(2000)), idle, "turn-1", finish=True)
    busier = [
        endpoint_state(i, waiting=2, running=3, kv=0.5) if f"e{i}" == home else endpoint_state(i)
        for i in range(4)
    ]
    # The extension hits ~94% of its blocks at home: the affinity filter keeps it there.
    follow_up, _ = pick(pipeline, [*range(2000), *range(50_000, 50_120)], busier, "turn-2")
    assert follow_up == home


@pytest.mark.parametrize(
    ("config", "spread"), [("predicted-latency-token-load", True), ("predicted-latency", False)]
)
def test_warming_up_copies_of_one_prompt_in_a_burst_spread_where_the_load_gate_is_on(
    config: str, spread: bool
) -> None:
    pipeline = warming_up(config)
    idle = [endpoint_state(i) for i in range(4)]
    # RL rollouts: one prompt sent four times at once, before any scrape shows a queue.
    picked = [pick(pipeline, list(range(2000)), idle, f"rollout-{i}")[0] for i in range(4)]
    assert len(set(picked)) == (4 if spread else 1)


def test_admitter_sheds_only_sheddable_requests_nobody_can_serve_in_slo() -> None:
    admitter = LatencySloAdmitter("adm", LatencySloAdmitterParameters(retryAfterSeconds=2), context())
    busy = [endpoint_state(0, running=3, kv=0.5), endpoint_state(1, waiting=2, kv=0.5)]
    hopeless = state_with({"e0": p(900, -600), "e1": p(800, -500)})
    sheddable, normal = make_request([]), make_request([])
    sheddable.priority = -1
    admitter.admit(normal, busy, hopeless)
    with pytest.raises(RequestShed) as info:
        admitter.admit(sheddable, busy, hopeless)
    assert info.value.status == 429 and info.value.headers()["retry-after"] == "2"
    admitter.admit(sheddable, busy, state_with({"e0": p(900, -600), "e1": p(100, 200)}))
    admitter.admit(sheddable, [*busy, endpoint_state(2)], hopeless)  # an idle endpoint
    admitter.admit(sheddable, busy, state_with(None))  # no predictions: cannot judge


def test_shipped_config_avoids_the_endpoint_predicted_to_violate_the_slo() -> None:
    fake = FakePredictor()
    ctx = PluginContext(clock=FakeClock(), rng=random.Random(5), latency_predictor=fake)
    pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path("predicted-latency")), ctx)
    endpoints = [endpoint_state(0, waiting=5, running=4), endpoint_state(1, waiting=0, running=4)]
    picks = []
    for i in range(200):
        request = streaming_request(slo_ttft_ms=300.0, request_id=f"r{i}")
        request.prompt_token_ids = list(range(i * 100, i * 100 + 70))
        picks.append(run(pipeline.schedule(request, endpoints, CycleState())).endpoint.name)
    # e0's predicted TTFT is 600 ms > 300 ms; only the tier filter's 1% exploration sends work there.
    assert picks.count("e0") <= 8, picks.count("e0")


def test_predicted_latency_config_needs_a_predictor() -> None:
    with pytest.raises(ConfigError, match="needs a latency predictor"):
        build_pipeline(EndpointPickerConfig.from_file(config_path("predicted-latency")), context())
