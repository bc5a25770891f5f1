from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.plugins.kv_cache_utilization_scorer import KVCacheUtilizationParameters, KVCacheUtilizationScorer
from epp.plugins.pickers import MaxScorePicker, PickerParameters, RandomPicker, WeightedRandomPicker
from epp.plugins.prefix_cache import (
    PREFIX_MATCH,
    ApproximatePrefixCacheProducer,
    ApproximatePrefixParameters,
    PrefixCacheScorer,
)
from epp.plugins.queue_scorer import QueueScorer
from epp.scheduling.framework import CycleState, NoParameters, PluginContext, ScoredEndpoint
from epp.scheduling.types import EndpointState, SchedulingResult
from tests.epp.factories import FakeClock, endpoint_state, make_request


def test_queue_scorer_is_min_max_inverse(context: PluginContext) -> None:
    scorer = QueueScorer("q", NoParameters(), context)
    endpoints = [endpoint_state(0, waiting=0), endpoint_state(1, waiting=5), endpoint_state(2, waiting=10)]
    assert scorer.score(make_request([]), endpoints, CycleState()) == [1.0, 0.5, 0.0]
    equal = [endpoint_state(0, waiting=3), endpoint_state(1, waiting=3)]
    assert scorer.score(make_request([]), equal, CycleState()) == [1.0, 1.0]


def test_kv_scorer_prefers_free_cache(context: PluginContext) -> None:
    scorer = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(), context)
    endpoints = [endpoint_state(0, kv=0.25), endpoint_state(1, kv=1.0)]
    assert scorer.score(make_request([]), endpoints, CycleState()) == [0.75, 0.0]


def _sized(i: int, kv: float, blocks: int | None) -> EndpointState:
    state = endpoint_state(i, kv=kv)
    state.metrics.num_gpu_blocks = blocks
    return state


def test_kv_scorer_by_blocks_compares_free_blocks_across_cache_sizes(context: PluginContext) -> None:
    scorer = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(measure="blocks"), context)
    # Half free on 29,000 blocks is 14,500 free; 80% free on 8,000 is 6,400; full holds none.
    endpoints = [_sized(0, 0.5, 29_000), _sized(1, 0.2, 8_000), _sized(2, 1.0, 8_000)]
    assert scorer.score(make_request([]), endpoints, CycleState()) == pytest.approx(
        [1.0, 6_400 / 14_500, 0.0]
    )
    percent = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(), context)
    assert percent.score(make_request([]), endpoints, CycleState()) == pytest.approx([0.5, 0.8, 0.0])


def test_kv_scorer_by_blocks_falls_back_to_percent_while_a_size_is_unknown(context: PluginContext) -> None:
    scorer = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(measure="blocks"), context)
    endpoints = [_sized(0, 0.5, 29_000), _sized(1, 0.2, None)]
    assert scorer.score(make_request([]), endpoints, CycleState()) == pytest.approx([0.5, 0.8])
    full = [_sized(0, 1.0, 29_000), _sized(1, 1.0, 8_000)]
    assert scorer.score(make_request([]), full, CycleState()) == [0.0, 0.0]


@given(
    usage=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
    blocks=st.integers(1, 100_000),
)
def test_kv_scorer_by_blocks_on_one_cache_size_is_percent_rescaled(usage: list[float], blocks: int) -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(0))
    endpoints = [_sized(i, u, blocks) for i, u in enumerate(usage)]
    by_blocks = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(measure="blocks"), context)
    by_percent = KVCacheUtilizationScorer("kv", KVCacheUtilizationParameters(), context)
    b = by_blocks.score(make_request([]), endpoints, CycleState())
    p = by_percent.score(make_request([]), endpoints, CycleState())
    most = max(p)
    assert b == pytest.approx([x / most for x in p] if most > 0 else p)  # the same order and ties


def test_prefix_producer_remembers_where_a_prompt_went(context: PluginContext) -> None:
    producer = ApproximatePrefixCacheProducer(
        "p", ApproximatePrefixParameters(blockSizeTokens=16, lruCapacityPerServer=1000), context
    )
    scorer = PrefixCacheScorer("s", NoParameters(), context)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    prompt = list(range(64))  # 4 blocks of 16

    first = CycleState()
    producer.produce(make_request(prompt), endpoints, first)
    assert scorer.score(make_request(prompt), endpoints, first) == [0.0, 0.0]
    producer.pre_request(make_request(prompt), SchedulingResult((endpoints[1].endpoint,), "p"), first)

    # Same first 3 blocks, different 4th block: 3 of 4 blocks match on e1 only.
    second = CycleState()
    follow_up = [*prompt[:48], *range(1000, 1016)]
    producer.produce(make_request(follow_up), endpoints, second)
    assert scorer.score(make_request(follow_up), endpoints, second) == [0.0, 0.75]
    # Another model never matches the same tokens.
    third = CycleState()
    producer.produce(make_request(prompt, model="other"), endpoints, third)
    assert third.get(PREFIX_MATCH).matched_blocks == {}


def test_prefix_capacity_follows_engine_cache_config(context: PluginContext) -> None:
    producer = ApproximatePrefixCacheProducer("p", ApproximatePrefixParameters(blockSizeTokens=16), context)
    small = endpoint_state(0)
    small.metrics.block_size, small.metrics.num_gpu_blocks = 16, 2  # 32 tokens = 2 blocks of 16
    state = CycleState()
    producer.produce(make_request(list(range(64))), [small], state)
    producer.pre_request(make_request(list(range(64))), SchedulingResult((small.endpoint,), "p"), state)
    assert producer.index.blocks_held("e0") == 2


def scored(scores: list[float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(endpoint_state(i), s) for i, s in enumerate(scores)]


def test_max_score_picker_ranks_and_breaks_ties_randomly(context: PluginContext) -> None:
    picker = MaxScorePicker("m", PickerParameters(maxNumOfEndpoints=3), context)
    ranked = picker.pick(make_request([]), scored([0.2, 0.9, 0.5]))
    assert [s.name for s in ranked] == ["e1", "e2", "e0"]
    winners = Counter(picker.pick(make_request([]), scored([1.0, 1.0, 0.0]))[0].name for _ in range(400))
    assert set(winners) == {"e0", "e1"}
    assert min(winners.values()) > 120


def test_weighted_random_picker_is_proportional_to_score(context: PluginContext) -> None:
    picker = WeightedRandomPicker("w", PickerParameters(), context)
    picks = Counter(picker.pick(make_request([]), scored([1.0, 3.0, 0.0]))[0].name for _ in range(4000))
    assert "e2" not in picks
    assert 0.70 < picks["e1"] / 4000 < 0.80  # expected 0.75


def test_random_picker_ignores_scores(context: PluginContext) -> None:
    picker = RandomPicker("r", PickerParameters(), context)
    picks = Counter(picker.pick(make_request([]), scored([0.0, 10.0]))[0].name for _ in range(1000))
    assert 400 < picks["e0"] < 600


def test_pickers_list_the_target_and_two_fallbacks_by_default(context: PluginContext) -> None:
    picker = MaxScorePicker("m", PickerParameters(), context)
    ranked = picker.pick(make_request([]), scored([0.1, 0.4, 0.3, 0.2, 0.0]))
    assert [s.name for s in ranked] == ["e1", "e2", "e3"]
