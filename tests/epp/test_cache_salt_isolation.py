"""Tenant isolation by ``cache_salt`` in both prefix indexes: a prompt cached under one salt (or
none) matches no block of the same prompt under another, and matches all of it under the same
salt, as vLLM's own prefix cache does (checked against real vLLM in
``tests/vllm/test_kv_index_vllm.py``)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvcache.block_hash import external_hash
from epp.kvcache.precise_index import PreciseIndex
from epp.plugins.precise_prefix_cache import PrecisePrefixCacheProducer, PrecisePrefixParameters
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer, ApproximatePrefixParameters
from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.types import SchedulingResult
from epp.vllm_wording import cache_salt_refusal
from tests.epp.factories import FakeClock, endpoint_state, make_request

BLOCK = 16
# Salts vLLM accepts (None: no salt), among them ones that differ by a character or a prefix.
SALTS = (
    st.none() | st.sampled_from(["a", "b", "ab", "tenant-1", "tenant-10"]) | st.text(min_size=1, max_size=12)
).filter(lambda salt: cache_salt_refusal(salt) is None)
TOKENS = st.lists(st.integers(0, 2047), min_size=BLOCK, max_size=6 * BLOCK)


def request(tokens: list[int], salt: str | None):
    made = make_request(tokens)
    made.cache_salt = salt
    return made


def matched(producer, tokens: list[int], salt: str | None) -> dict[str, int]:
    state = CycleState()
    producer.produce(request(tokens, salt), [endpoint_state(i) for i in range(2)], state)
    return {name: blocks for name, blocks in state.get(PREFIX_MATCH).matched_blocks.items() if blocks}


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, cached=SALTS, probe=SALTS)
def test_the_approximate_index_shares_prefixes_within_a_salt_only(
    tokens: list[int], cached: str | None, probe: str | None
) -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1))
    params = ApproximatePrefixParameters(blockSizeTokens=BLOCK)
    producer = ApproximatePrefixCacheProducer("a", params, context)
    first, state = request(tokens, cached), CycleState()
    endpoints = [endpoint_state(i) for i in range(2)]
    producer.produce(first, endpoints, state)
    producer.pre_request(first, SchedulingResult((endpoints[1].endpoint,), "default"), state)
    expected = {endpoints[1].name: len(tokens) // BLOCK} if probe == cached else {}
    assert matched(producer, tokens, probe) == expected


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, cached=SALTS, probe=SALTS)
def test_the_precise_index_matches_the_engines_blocks_within_a_salt_only(
    tokens: list[int], cached: str | None, probe: str | None
) -> None:
    index = PreciseIndex()
    context = PluginContext(clock=FakeClock(), rng=random.Random(1), kv_index=index)
    producer = PrecisePrefixCacheProducer("p", PrecisePrefixParameters(blockSizeTokens=BLOCK), context)
    # What an engine's BlockStored events name after it cached the prompt under ``cached``.
    index.add_endpoint("e1")
    index.store("e1", [external_hash(d) for d in producer.hasher.chain(tokens, BLOCK, cache_salt=cached)])
    expected = {"e1": len(tokens) // BLOCK} if probe == cached else {}
    assert matched(producer, tokens, probe) == expected
