"""Incremental block hashing: the chains remembered with a cached prompt give the same hashes as
hashing the whole prompt, and only the new blocks are hashed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvcache.approximate_index import prefix_block_hashes
from epp.kvcache.block_chains import CHAIN_BLOCK_BYTES, BlockChains, block_chains_of
from epp.kvcache.block_hash import BlockHasher, chain_hashes
from epp.plugins.precise_prefix_cache import PrecisePrefixCacheProducer, PrecisePrefixParameters
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer, ApproximatePrefixParameters
from epp.scheduling.framework import PluginContext
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from tests.epp.factories import FakeClock, make_request
from tests.epp.tokenizers_under_test import texts

CONTEXT = PluginContext(clock=FakeClock(), rng=random.Random(1))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2047), max_size=300),
    block_size=st.integers(1, 20),
    max_blocks=st.none() | st.integers(0, 30),
    split=st.integers(0, 40),
)
def test_approximate_chain_extended_from_known_hashes_equals_the_full_chain(
    tokens: list[int], block_size: int, max_blocks: int | None, split: int
) -> None:
    full = prefix_block_hashes(tokens, block_size, "seed", max_blocks)
    assert prefix_block_hashes(tokens, block_size, "seed", max_blocks, known=full[:split]) == full


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2047), max_size=200), split=st.integers(0, 20), stop=st.integers(0, 220)
)
def test_vllm_chain_extended_up_to_a_stop_equals_the_full_chain(
    tokens: list[int], split: int, stop: int
) -> None:
    hasher, size = BlockHasher("xxhash", "seed"), 8
    full = hasher.chain(tokens[:stop], size, cache_salt="salt")
    known = full[:split]
    rest = hasher.chain(
        tokens,
        size,
        parent=known[-1] if known else None,
        start=len(known) * size,
        stop=stop,
        cache_salt="salt",
    )
    assert known + rest == full


def _conversation_requests(tokenizer: ModelTokenizer, turns: list[str], salt: str | None = None, branch=None):
    """A request per turn of a growing conversation; with ``branch``, also one per turn whose last
    message is ``branch`` instead (a prompt that parts from a cached one)."""
    messages = []
    for turn, content in enumerate(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        variants = [[*messages, {"role": role, "content": content}]]
        if branch is not None:
            variants.append([*messages, {"role": role, "content": branch}])
        for variant in variants:
            request = make_request(tokenizer.encode_chat(variant))
            request.cache_salt = salt
            yield request
        messages = variants[0]


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(texts(80), min_size=1, max_size=8),
    branch=texts(40),
    salt=st.none() | st.sampled_from(["tenant-a", "tenant-b"]),
    block_size=st.sampled_from([16, 32, 64]),
    max_blocks=st.integers(1, 40),
)
def test_producers_hash_cached_prompts_as_whole_prompts(
    turns: list[str], branch: str, salt: str | None, block_size: int, max_blocks: int
) -> None:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=16 << 20)
    limits = {"blockSizeTokens": block_size, "maxPrefixBlocksToMatch": max_blocks}
    approximate = ApproximatePrefixCacheProducer("a", ApproximatePrefixParameters(**limits), CONTEXT)
    precise = PrecisePrefixCacheProducer("p", PrecisePrefixParameters(**limits), CONTEXT)
    for request in _conversation_requests(tokenizer, turns * 2, salt, branch):
        tokens = list(request.prompt_token_ids)
        full = prefix_block_hashes(tokens, block_size, f"tiny\x00{salt or ''}", max_blocks)
        assert approximate.block_hashes(request) == full
        engine = precise.hasher.external_chain(tokens[: max_blocks * block_size], block_size, cache_salt=salt)
        assert precise.block_hashes(request) == engine
        assert precise.block_hashes(request) == engine  # again, from its own remembered chain


def test_a_growing_conversation_hashes_only_its_new_blocks(monkeypatch) -> None:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=16 << 20)
    producer = PrecisePrefixCacheProducer("p", PrecisePrefixParameters(blockSizeTokens=16), CONTEXT)
    hashed: list[int] = []
    real_chain = BlockHasher.chain

    def counting_chain(self, tokens, block_size, **kwargs):
        digests = real_chain(self, tokens, block_size, **kwargs)
        hashed.append(len(digests))
        return digests

    monkeypatch.setattr(BlockHasher, "chain", counting_chain)
    turns = [f"turn {i}: " + "some words to fill blocks " * 20 for i in range(6)]
    previous_blocks = 0
    for request in _conversation_requests(tokenizer, turns):
        blocks = len(request.prompt_token_ids) // 16
        assert producer.block_hashes(request) == [
            h for h in producer.hasher.external_chain(request.prompt_token_ids, 16)
        ]
        new_blocks = hashed[-2]  # the call before is the check's own full chain
        assert new_blocks <= blocks - previous_blocks + 2  # the reused prefix ends a block or two early
        previous_blocks = blocks
    assert sum(hashed[0::2]) < sum(hashed[1::2]) / 2


def test_known_chains_cover_only_the_shared_tokens() -> None:
    inherited = {"k": list(range(10))}
    chains = BlockChains(inherited, shared_tokens=35, own={}, grew=None)
    assert chains.known("k", 8) == [0, 1, 2, 3]  # 35 shared tokens hold 4 full blocks of 8
    assert chains.known("other", 8) == []
    chains.remember("k", list(range(6)))
    assert chains.known("k", 8) == list(range(6))  # its own chain now
    assert BlockChains(None, 0, None).known("k", 8) == []


def test_remembered_chains_count_in_the_cache_memory() -> None:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=16 << 20)
    ids = tokenizer.encode("a prompt long enough for the cache " * 20)
    chains = block_chains_of(ids)
    before = tokenizer.cache.stats().bytes
    chains.remember("k", list(range(12)))
    chains.remember("k", list(range(5)))  # shorter: ignored
    assert tokenizer.cache.stats().bytes == before + 12 * CHAIN_BLOCK_BYTES
    assert block_chains_of(tokenizer.encode("a prompt long enough for the cache " * 20)).known(
        "k", 1
    ) == list(range(12))


def test_plain_chain_hashes_are_unchanged_by_stop() -> None:
    tokens = list(range(100))
    assert chain_hashes(tokens, 16, stop=64) == chain_hashes(tokens[:64], 16)
