"""The candidate sampler: a large pool narrowed to the endpoints where the prompt is cached, the
least busy and a random few; the producers it does not read, and the profile, see only those."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.observability.decision import TraceSource
from epp.plugins.candidate_sampler import CandidateSamplerParameters, PrefixLoadSampler, busy
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.trace import SCHEDULING_TRACE
from tests.epp.factories import FakeClock, endpoint_state, make_request

SAMPLED = """
plugins:
- type: approximate-prefix-cache-producer
- type: token-load-producer
- type: candidate-sampler
  parameters: {maxCandidates: 6, prefixCandidates: 2, leastLoadedCandidates: 2}
- type: token-load-scorer
- type: max-score-picker
"""


def sampler(seed: int = 1, **params: int) -> PrefixLoadSampler:
    context = PluginContext(clock=FakeClock(), rng=random.Random(seed))
    return PrefixLoadSampler("s", CandidateSamplerParameters.model_validate(params), context)


def with_match(matched: dict[str, int], total: int = 8) -> CycleState:
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(total, matched))
    return state


def test_a_pool_no_larger_than_the_sample_passes_whole() -> None:
    pool = [endpoint_state(i) for i in range(16)]
    assert sampler().sample(make_request([1]), pool, CycleState()) is pool


def test_the_sample_holds_the_cached_the_least_busy_and_random_endpoints_in_pool_order() -> None:
    pool = [endpoint_state(i, running=10) for i in range(40)]
    for i in (30, 31, 32):  # the least busy
        pool[i].metrics.running = 0
    pool[33].in_flight = 3  # 13 requests: busier than the rest, never among the least busy
    state = with_match({"e5": 4, "e6": 7, "e7": 1, "gone": 8})  # "gone" left the pool
    picked = sampler(maxCandidates=8, prefixCandidates=2, leastLoadedCandidates=3).sample(
        make_request([1]), pool, state
    )
    names = [e.name for e in picked]
    assert len(names) == 8
    assert names == sorted(names, key=lambda n: int(n[1:]))
    assert {"e6", "e5", "e30", "e31", "e32"} <= set(names)


def test_an_idle_pool_is_sampled_all_over_not_from_its_head() -> None:
    pool = [endpoint_state(i) for i in range(100)]
    s = sampler(seed=3)
    seen = Counter(e.name for _ in range(200) for e in s.sample(make_request([1]), pool, CycleState()))
    assert len(seen) == 100
    # The least-loaded half of each sample (all tied at 0) comes from a random rotation, so no
    # endpoint is sampled far more often than the mean (200 × 16 / 100 = 32).
    assert max(seen.values()) < 3 * 32


@settings(max_examples=200, deadline=None)
@given(
    busy_counts=st.lists(st.integers(0, 50), min_size=1, max_size=60),
    blocks=st.dictionaries(st.integers(0, 59), st.integers(0, 20)),
    size=st.integers(1, 20),
    prefix=st.integers(0, 6),
    least=st.integers(0, 8),
    seed=st.integers(0, 1000),
)
def test_the_sample_matches_a_plain_reference(busy_counts, blocks, size, prefix, least, seed) -> None:
    prefix, least = min(prefix, size), min(least, size - min(prefix, size))
    pool = [endpoint_state(i, running=n) for i, n in enumerate(busy_counts)]
    matched = {f"e{i}": n for i, n in blocks.items()}
    picked = sampler(seed, maxCandidates=size, prefixCandidates=prefix, leastLoadedCandidates=least).sample(
        make_request([1]), pool, with_match(matched)
    )
    names = [e.name for e in picked]
    assert len(names) == len(set(names)) == min(size, len(pool))
    assert names == [e.name for e in pool if e.name in set(names)]
    if len(pool) <= size:
        return
    held = sorted((n for name, n in matched.items() if n > 0 and int(name[1:]) < len(pool)), reverse=True)
    if prefix and held:
        # Every endpoint holding more blocks than the prefix quota's last one is in the sample.
        cut = held[min(prefix, len(held)) - 1]
        assert all(name in names for name, n in matched.items() if n > cut and int(name[1:]) < len(pool))
    if least:
        # However the prefix quota fell, the sample holds at least `least` endpoints no busier
        # than the `least`-th least busy of the pool.
        bar = sorted(busy(e) for e in pool)[least - 1 + prefix]
        assert sum(busy(e) <= bar for e in picked) >= least


def test_parameters_must_fit_the_sample() -> None:
    with pytest.raises(ConfigError, match="exceeds maxCandidates"):
        build_pipeline(
            EndpointPickerConfig.from_yaml(
                "plugins: [{type: candidate-sampler, parameters: {maxCandidates: 4, prefixCandidates: 3,"
                " leastLoadedCandidates: 2}}]"
            ),
            PluginContext(clock=FakeClock(), rng=random.Random(1)),
        )


def test_one_sampler_at_most(context: PluginContext) -> None:
    text = "plugins: [{name: a, type: candidate-sampler}, {name: b, type: candidate-sampler}]"
    with pytest.raises(ConfigError, match="2 candidate samplers"):
        build_pipeline(EndpointPickerConfig.from_yaml(text), context)


def test_the_prefix_runs_over_the_pool_and_the_rest_over_the_sample(context: PluginContext) -> None:
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(SAMPLED), context)
    assert [p.type_name for p in pipeline.sampling_inputs] == ["approximate-prefix-cache-producer"]
    assert [p.type_name for p in pipeline.producers] == ["token-load-producer"]
    pool = [endpoint_state(i) for i in range(30)]
    request = make_request(list(range(256)), request_id="first")
    first = CycleState()
    result = asyncio.run(pipeline.schedule(request, pool, first))
    # The first request's prompt is now cached where it went: the next one's sample holds it.
    second = CycleState()
    again = asyncio.run(pipeline.schedule(make_request(list(range(256)), request_id="again"), pool, second))
    assert second.get(PREFIX_MATCH).matched_blocks == {result.endpoint.name: 4}
    loads = second.get(TOKEN_LOAD)
    assert len(loads) == 6 and result.endpoint.name in loads
    trace = second.get(SCHEDULING_TRACE)
    assert trace.sampled_from == 30 and len(trace.candidates) == 6
    booked = next(e for e in pool if e.name == again.endpoint.name)
    decision = TraceSource.of(RoutedRequest(request, again, second, booked, 0.0)).build()
    assert decision["sampled_from"] == 30 and decision["candidates"] == 6


def test_a_small_pool_records_no_sampling(context: PluginContext) -> None:
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(SAMPLED), context)
    state = CycleState()
    asyncio.run(
        pipeline.schedule(make_request(list(range(64))), [endpoint_state(i) for i in range(6)], state)
    )
    assert state.get(SCHEDULING_TRACE).sampled_from is None
    assert len(state.get(TOKEN_LOAD)) == 6
