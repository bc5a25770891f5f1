"""The precise prefix producer and scorer: the engine's hashes, the precise index, fallback."""

from __future__ import annotations

import random

import pytest

from epp.configs import config_path
from epp.kvcache.block_hash import BlockHasher, chain_hashes, external_hash
from epp.kvcache.precise_index import PreciseIndex
from epp.plugins.precise_prefix_cache import PrecisePrefixCacheProducer, PrecisePrefixParameters
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import FakeClock, endpoint_state, make_request

BLOCK = 32
TOKENS = list(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and a partial one


def engine_hashes(tokens: list[int], **kwargs) -> list[int]:
    return [external_hash(d) for d in chain_hashes(tokens, BLOCK, **kwargs)]


@pytest.fixture
def index() -> PreciseIndex:
    return PreciseIndex()


@pytest.fixture
def producer(index: PreciseIndex) -> PrecisePrefixCacheProducer:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1), kv_index=index)
    return PrecisePrefixCacheProducer("p", PrecisePrefixParameters(), context)


def produce(producer: PrecisePrefixCacheProducer, tokens: list[int], n: int = 3, **fields):
    request = make_request(tokens)
    for key, value in fields.items():
        setattr(request, key, value)
    endpoints = [endpoint_state(i) for i in range(n)]
    state = CycleState()
    producer.produce(request, endpoints, state)
    return request, endpoints, state


def test_hashes_the_prompt_as_the_engine_names_its_blocks(producer: PrecisePrefixCacheProducer) -> None:
    _, _, state = produce(producer, TOKENS)
    match = state.get(PREFIX_MATCH)
    assert match.block_hashes == engine_hashes(TOKENS) and match.total_blocks == 5
    assert match.block_size_tokens == BLOCK
    _, _, salted = produce(producer, TOKENS, cache_salt="tenant")
    assert salted.get(PREFIX_MATCH).block_hashes == engine_hashes(TOKENS, cache_salt="tenant")


def test_live_endpoints_are_matched_from_their_engines_events(
    producer: PrecisePrefixCacheProducer, index: PreciseIndex
) -> None:
    hashes = engine_hashes(TOKENS)
    for name in ("e0", "e1", "e2"):
        index.add_endpoint(name)
    index.store("e1", hashes)
    index.store("e2", hashes[:2])
    request, endpoints, state = produce(producer, TOKENS)
    match = state.get(PREFIX_MATCH)
    assert match.matched_blocks == {"e1": 5, "e2": 2}
    assert match.cached_tokens("e1", request.input_tokens) == 5 * BLOCK
    # Routing history does not override what the engines report for live endpoints.
    producer.pre_request(request, SchedulingResult((endpoints[0].endpoint,), "default"), state)
    assert produce(producer, TOKENS)[2].get(PREFIX_MATCH).matched_blocks == {"e1": 5, "e2": 2}


def test_stale_and_untracked_endpoints_fall_back_to_routing_history(
    producer: PrecisePrefixCacheProducer, index: PreciseIndex
) -> None:
    hashes = engine_hashes(TOKENS)
    index.add_endpoint("e1")
    index.store("e1", hashes)
    request, endpoints, state = produce(producer, TOKENS)
    producer.pre_request(request, SchedulingResult((endpoints[0].endpoint,), "default"), state)
    # e0 has no events source: what it was sent counts.
    assert produce(producer, TOKENS)[2].get(PREFIX_MATCH).matched_blocks == {"e0": 5, "e1": 5}
    index.set_stale("e1", True)  # e1's events stopped, and it was never sent the prompt
    assert produce(producer, TOKENS)[2].get(PREFIX_MATCH).matched_blocks == {"e0": 5}


def test_without_a_kv_index_every_endpoint_is_matched_from_routing_history() -> None:
    producer = PrecisePrefixCacheProducer(
        "p", PrecisePrefixParameters(), PluginContext(clock=FakeClock(), rng=random.Random(1))
    )
    request, endpoints, state = produce(producer, TOKENS)
    assert state.get(PREFIX_MATCH).matched_blocks == {}
    producer.pre_request(request, SchedulingResult((endpoints[2].endpoint,), "default"), state)
    assert produce(producer, TOKENS)[2].get(PREFIX_MATCH).matched_blocks == {"e2": 5}


def test_hash_algorithm_and_seed_are_the_engines() -> None:
    xx = BlockHasher("xxhash", "42")
    params = PrecisePrefixParameters.model_validate(
        {"hashAlgo": "xxhash", "hashSeed": "42", "blockSizeTokens": 16}
    )
    producer = PrecisePrefixCacheProducer("p", params, PluginContext(clock=FakeClock()))
    _, _, state = produce(producer, TOKENS)
    assert state.get(PREFIX_MATCH).block_hashes == xx.external_chain(TOKENS, 16)
    assert xx.external_chain(TOKENS, 16) != BlockHasher("xxhash").external_chain(TOKENS, 16)
    with pytest.raises(ValueError):
        PrecisePrefixParameters.model_validate({"hashAlgo": "sha256_cbor"})


def test_shipped_precise_config_scores_with_the_engines_cache(index: PreciseIndex) -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(7), kv_index=index)
    pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path("precise-prefix")), context)
    weights = {ws.scorer.type_name: ws.weight for ws in pipeline.profile.scorers}
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "precise-prefix-cache-scorer": 3}
    assert [p.type_name for p in pipeline.producers] == ["precise-prefix-cache-scorer"]
    index.add_endpoint("e2")
    index.store("e2", engine_hashes(TOKENS))
    request = make_request(TOKENS)
    endpoints = [endpoint_state(i) for i in range(3)]
    state = CycleState()
    scorer = pipeline.plugins["precise-prefix-cache-scorer"]
    scorer.produce(request, endpoints, state)
    assert scorer.score(request, endpoints, state) == [0.0, 0.0, 1.0]


def test_the_producer_feeds_the_plain_prefix_scorer_and_excludes_a_second_producer(
    context: PluginContext,
) -> None:
    config = EndpointPickerConfig.from_yaml(
        "plugins: [{type: precise-prefix-cache-producer}, {type: prefix-cache-scorer}]"
    )
    pipeline = build_pipeline(config, context)
    assert [p.type_name for p in pipeline.producers] == ["precise-prefix-cache-producer"]
    both = EndpointPickerConfig.from_yaml(
        "plugins: [{type: precise-prefix-cache-scorer}, {type: approximate-prefix-cache-producer}]"
    )
    with pytest.raises(ConfigError, match="produced by both"):
        build_pipeline(both, context)
