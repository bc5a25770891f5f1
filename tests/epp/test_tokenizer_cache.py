"""The tokenizer cache gives the ids of a full tokenization, whatever the prompts, and reuses them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from epp.kvcache.block_chains import block_chains_of
from epp.metrics import TokenizerCacheCollector
from epp.tokenizer.cache import (
    FIRST_CHUNK_BYTES,
    TokenizerCache,
    TooLongToInline,
    agreed_length,
    chunk_keys,
)
from epp.tokenizer.cuts import cut_points
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from tests.epp.tokenizers_under_test import TOKENIZERS, encode, texts

PLAIN = ModelTokenizer(TINY_MODEL_DIR)
ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


def cached_tokenizer(capacity: int = 64 << 20) -> ModelTokenizer:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=capacity)
    assert tokenizer.cache is not None
    return tokenizer


def cache_for(tokenizer: Tokenizer, capacity: int = 64 << 20) -> TokenizerCache:
    return TokenizerCache(cut_points(tokenizer), lambda text: encode(tokenizer, text), capacity)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(ROLES, texts(60)), min_size=1, max_size=12))
def test_conversations_through_the_chat_template_tokenize_as_a_whole(turns: list[tuple[str, str]]) -> None:
    tokenizer = cached_tokenizer()
    messages: list[dict[str, str]] = []
    for role, content in turns:
        messages.append({"role": role, "content": content})
        assert tokenizer.encode_chat(messages) == PLAIN.encode_chat(messages)
    stats = tokenizer.cache.stats()
    assert stats.fallbacks == 0 and stats.mismatches == 0
    assert stats.cut_failures == 0


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=80, deadline=None)
@given(start=texts(80), extensions=st.lists(texts(20), min_size=1, max_size=6), branch=texts(20))
def test_extended_and_branched_texts_tokenize_as_a_whole(
    name: str, start: str, extensions: list[str], branch: str
) -> None:
    """Each extension may start mid-word, inside a whitespace run, or inside an added token; a
    branch shares all but the end of an earlier text."""
    tokenizer = TOKENIZERS[name]
    cache = cache_for(tokenizer)
    text = start
    seen = []
    for extension in extensions:
        text += extension
        seen.append(text)
        assert cache.encode(text) == encode(tokenizer, text)
    for earlier in seen:
        assert cache.encode(earlier + branch) == encode(tokenizer, earlier + branch)
        assert cache.encode(earlier[: len(earlier) // 2]) == encode(tokenizer, earlier[: len(earlier) // 2])
    assert cache.stats().cut_failures == 0


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("x" * 300 + " hel", "x" * 300 + " hello there"),  # mid-word
        ("y" * 300 + " a   ", "y" * 300 + " a    b"),  # inside a whitespace run
        ("z" * 300 + " <|us", "z" * 300 + " <|user|> hi"),  # inside an added token
        ("w" * 300 + " caf" + "é" * 10, "w" * 300 + " caf" + "é" * 9 + "è"),  # differs mid-character
        ("v" * 300 + " 😀 x", "v" * 300 + " 😀‍💻 x"),  # a joiner after an emoji
        ("u" * 300 + " it'", "u" * 300 + " it're"),  # a contraction completed
    ],
)
def test_cuts_hold_where_the_texts_part(old: str, new: str) -> None:
    tokenizer = cached_tokenizer()
    old_text, new_text = ("word " * 60) + old, ("word " * 60) + new
    assert tokenizer.encode(old_text) == PLAIN.encode(old_text)
    assert tokenizer.encode(new_text) == PLAIN.encode(new_text)
    assert tokenizer.cache.stats().hits == 1


@pytest.mark.parametrize("name", ["llama3", "o200k"])
def test_a_text_ending_in_an_added_token_may_continue_into_a_longer_one(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    cache = cache_for(tokenizer)
    old, new = "some words here " * 20 + "<think></t", "some words here " * 20 + "<think></think> ok"
    assert cache.encode(old) == encode(tokenizer, old)
    assert cache.encode(new) == encode(tokenizer, new)
    assert tokenizer.token_to_id("<think></think>") in encode(tokenizer, new)
    stats = cache.stats()
    assert (stats.hits, stats.cut_failures) == (1, 0)


def test_a_growing_conversation_reuses_all_but_its_new_turns() -> None:
    tokenizer = cached_tokenizer()
    messages = [{"role": "system", "content": "You are terse. " * 40}]
    reused = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} squared? " * 5})
        before = tokenizer.cache.stats().tokens_reused
        ids = tokenizer.encode_chat(messages)
        assert ids == PLAIN.encode_chat(messages)
        reused.append((tokenizer.cache.stats().tokens_reused - before, len(ids)))
        messages.append({"role": "assistant", "content": f"{turn * turn}. " * 10})
    stats = tokenizer.cache.stats()
    assert (stats.misses, stats.hits, stats.fallbacks) == (1, 5, 0)
    assert stats.entries == 1  # each turn's prompt replaced the one it extends
    for (got, total), (_, previous_total) in zip(reused[1:], reused, strict=False):
        assert previous_total - 10 <= got < total  # only the previous prompt's last few tokens redone


def test_interleaved_conversations_sharing_a_system_prompt_each_reuse_their_own_last_turn() -> None:
    # The index names a shared prefix's chunks by one entry only (the latest): each session must
    # still find its own previous prompt, past the shared part, among the others'.
    tokenizer = cached_tokenizer()
    system = {"role": "system", "content": "You are a coding agent in a shared repository. " * 30}
    sessions = [[system] for _ in range(3)]
    last_lengths = [0] * len(sessions)
    for turn in range(5):
        for index, messages in enumerate(sessions):
            messages.append({"role": "user", "content": f"Session {index}, step {turn}: run the tests. " * 8})
            before = tokenizer.cache.stats().tokens_reused
            ids = tokenizer.encode_chat(messages)
            assert ids == PLAIN.encode_chat(messages)
            reused = tokenizer.cache.stats().tokens_reused - before
            if turn > 0:
                assert last_lengths[index] - 10 <= reused < len(ids)
            last_lengths[index] = len(ids)
            messages.append({"role": "assistant", "content": f"Step {turn} of session {index} passed. " * 4})
    stats = tokenizer.cache.stats()
    # Only the very first prompt misses: the other sessions' first prompts reuse the system prompt.
    assert (stats.misses, stats.fallbacks, stats.entries) == (1, 0, 3)


def test_identical_prompts_are_served_from_the_cache() -> None:
    tokenizer = cached_tokenizer()
    text = "the same prompt again " * 30
    first, second = tokenizer.encode(text), tokenizer.encode(text)
    assert first == second == PLAIN.encode(text) and first is not second
    assert tokenizer.cache.stats().tokens_reused == len(first)


def test_an_inline_limit_refuses_long_tokenizations_and_leaves_the_cache_as_it_was() -> None:
    tokenizer = cached_tokenizer()
    seen = "An earlier turn of the conversation. " * 40
    with pytest.raises(TooLongToInline):
        tokenizer.encode(seen, max_chars=len(seen) - 1)  # a miss: all of it is new
    assert tokenizer.cache.stats() == cached_tokenizer().cache.stats()  # nothing counted or kept
    assert tokenizer.encode(seen, max_chars=len(seen)) == PLAIN.encode(seen)
    extended = seen + "And the next, a few words longer. " * 3
    # The extension tokenizes only its new words (and a few tokens before them) under the limit.
    ids = tokenizer.encode(extended, max_chars=len(extended) - len(seen) + 100)
    assert ids == PLAIN.encode(extended)
    with pytest.raises(TooLongToInline):
        tokenizer.encode(extended + "More. " * 50, max_chars=len(extended) - len(seen) + 100)
    after = tokenizer.cache.stats()
    assert (after.misses, after.hits, after.fallbacks, after.entries) == (1, 1, 0, 1)


def test_an_inline_limit_without_a_cache_bounds_the_whole_text() -> None:
    text = "short words " * 10
    assert PLAIN.encode(text, max_chars=len(text)) == PLAIN.encode(text)
    with pytest.raises(TooLongToInline):
        PLAIN.encode(text, max_chars=len(text) - 1)


def test_an_inline_limit_sends_verify_modes_full_tokenization_away_too() -> None:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=64 << 20, verify_cache=True)
    seen = "A verified turn. " * 40
    tokenizer.encode(seen)
    with pytest.raises(TooLongToInline):  # the reuse itself is short, its check is not
        tokenizer.encode(seen + "New. ", max_chars=100)
    assert tokenizer.encode(seen + "New. ") == PLAIN.encode(seen + "New. ")


def test_text_without_a_cut_falls_back_to_full_tokenization() -> None:
    tokenizer = cached_tokenizer()
    text = "a" * 600
    tokenizer.encode(text)
    assert tokenizer.encode(text + "b") == PLAIN.encode(text + "b")
    assert tokenizer.cache.stats().fallbacks == 1


def test_long_new_text_is_tokenized_in_pieces_with_the_whole_texts_ids() -> None:
    tiny, calls = TOKENIZERS["tiny"], []

    def counted(text: str) -> list[int]:
        calls.append(text)
        return encode(tiny, text)

    cache = TokenizerCache(cut_points(tiny), counted, 64 << 20)
    text = "def handler(event):\n    return event['body']  # done\n" * 200
    assert cache.encode(text) == encode(tiny, text) and len(calls) > 5
    calls.clear()
    longer = text + "and the next turn " * 200
    assert cache.encode(longer) == encode(tiny, longer) and len(calls) > 2
    assert len("".join(calls)) < len(longer) - len(text) + 200  # only the new text, and an overlap


def test_verify_mode_checks_a_text_tokenized_in_pieces() -> None:
    """A tokenizer that appends a bogus id to texts starting with a space (every piece but the first)."""
    tiny = TOKENIZERS["tiny"]

    def lying(text: str) -> list[int]:
        return encode(tiny, text) + ([3] if text.startswith(" ") else [])

    cache = TokenizerCache(cut_points(tiny), lying, 64 << 20, verify=True)
    text = "alpha beta gamma delta " * 200
    assert cache.encode(text) == encode(tiny, text)
    assert (cache.stats().verified, cache.stats().mismatches) == (1, 1)


def test_short_texts_bypass_the_cache() -> None:
    tokenizer = cached_tokenizer()
    text = "x " * (FIRST_CHUNK_BYTES // 2 - 1)
    assert tokenizer.encode(text) == PLAIN.encode(text)
    assert tokenizer.encode(text + "y") == PLAIN.encode(text + "y")
    stats = tokenizer.cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (0, 0, 0)


def test_a_cut_that_does_not_verify_falls_back() -> None:
    """Token lengths off by one put every cut in the wrong place; the overlap check catches it."""
    tiny = TOKENIZERS["tiny"]
    cuts = cut_points(tiny)
    wrong = type(cuts)(tuple(n + 1 for n in cuts.token_bytes), cuts.added, cuts.max_added_bytes)
    cache = TokenizerCache(wrong, lambda text: encode(tiny, text), 64 << 20)
    text = "one two three four five six seven eight nine ten " * 20
    cache.encode(text)
    assert cache.encode(text + "eleven") == encode(tiny, text + "eleven")
    assert cache.stats().fallbacks == 1


def test_verify_mode_counts_a_wrong_reuse_and_returns_the_full_tokenization() -> None:
    """A tokenizer that appends a bogus id to texts starting with a space (the rest of a cut)."""
    tiny = TOKENIZERS["tiny"]

    def lying(text: str) -> list[int]:
        return encode(tiny, text) + ([3] if text.startswith(" ") else [])

    cache = TokenizerCache(cut_points(tiny), lying, 64 << 20, verify=True)
    text = "alpha beta gamma delta " * 20
    cache.encode(text)
    assert cache.encode(text + "epsilon") == encode(tiny, text + "epsilon")  # a cut: caught lying
    # Both texts are now cached whole (the full tokenization was kept): no cut, nothing to lie about.
    assert cache.encode(text) == encode(tiny, text)
    assert cache.encode(text + "epsilon") == encode(tiny, text + "epsilon")
    stats = cache.stats()
    assert (stats.verified, stats.mismatches, stats.hits) == (3, 1, 2)


def test_memory_is_bounded_and_the_least_recently_used_go_first() -> None:
    tokenizer = cached_tokenizer(capacity=150_000)
    prompts = [f"conversation {i}: " + "lorem ipsum dolor sit amet " * 100 for i in range(8)]
    for prompt in prompts:
        tokenizer.encode(prompt)
        assert tokenizer.cache.stats().bytes <= 150_000
    entries = tokenizer.cache.stats().entries
    assert 1 < entries < len(prompts)
    tokenizer.encode(prompts[-entries])  # the oldest kept: a hit, and now the most recent
    tokenizer.encode(prompts[0])  # evicted long ago: a miss that evicts the next oldest
    tokenizer.encode(prompts[-entries + 1])
    stats = tokenizer.cache.stats()
    assert (stats.hits, stats.misses) == (1, len(prompts) + 2)


def test_concurrent_encodes_from_threads_stay_exact() -> None:
    tokenizer = cached_tokenizer(capacity=2 << 20)
    base = "shared system prompt with words " * 40
    texts_ = [base + f"request {i} " * (i % 17) + "tail" for i in range(300)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(tokenizer.encode, texts_))
    assert results == [PLAIN.encode(t) for t in texts_]
    assert tokenizer.cache.stats().hits > 0


def test_lone_surrogates_behave_as_without_the_cache() -> None:
    tokenizer = cached_tokenizer()
    with pytest.raises(TypeError):
        PLAIN.encode("x\ud800" * 200)
    with pytest.raises(TypeError):
        tokenizer.encode("x\ud800" * 200)


def test_an_unsupported_tokenizer_gets_no_cache(tmp_path) -> None:
    config = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    tokenizer = ModelTokenizer(tmp_path, cache_bytes=1 << 20)
    assert tokenizer.cache is None
    assert tokenizer.encode("caf\u0065\u0301 " * 100) == PLAIN.encode("caf\u00e9 " * 100)


def test_ids_carry_block_chains_only_from_the_cache() -> None:
    tokenizer = cached_tokenizer()
    assert block_chains_of(tokenizer.encode("long enough to be cached " * 20)) is not None
    assert block_chains_of(PLAIN.encode("long enough to be cached " * 20)) is None


def test_metrics_export_the_counts_and_size() -> None:
    tokenizer = cached_tokenizer()
    registry = CollectorRegistry()
    registry.register(TokenizerCacheCollector("pool", tokenizer.cache))
    text = "metrics are read at scrape time " * 20
    tokenizer.encode(text)
    tokenizer.encode(text + "and more")

    def sample(name: str) -> float | None:
        return registry.get_sample_value(f"llm_epp_tokenizer_cache_{name}", {"name": "pool"})

    assert sample("hits_total") == 1 and sample("misses_total") == 1 and sample("fallbacks_total") == 0
    assert sample("tokens_reused_total") == tokenizer.cache.stats().tokens_reused > 0
    assert sample("entries") == 1 and sample("bytes") == tokenizer.cache.stats().bytes > len(text)
    assert sample("mismatches_total") == 0


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_chunk_keys_and_agreed_length(a: bytes, b: bytes) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert agreed_length(a, b, 0) == common
    keys_a, keys_b = chunk_keys(a), chunk_keys(b)
    shared = [x == y for x, y in zip(keys_a, keys_b, strict=False)]
    assert shared == sorted(shared, reverse=True)  # chained: once different, always different


@settings(max_examples=100, deadline=None)
@given(text=texts(60))
def test_whole_texts_are_tokenized_as_the_tokenizer_does(text: str) -> None:
    """``ModelTokenizer`` tokenizes whole texts with ``encode_batch_fast`` (no offsets): same ids."""
    assert PLAIN.encode(text) == encode(TOKENIZERS["tiny"], text)
