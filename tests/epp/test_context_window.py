"""Prompts over the model's context: vLLM's answers, without tokenizing all of a long prompt."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.errors import BadRequest
from epp.requestcontrol.context_window import check_token_ids, encode_prompt, word_start
from epp.requestcontrol.openai_request import parse_openai_request
from epp.tokenizer.model import ModelTokenizer
from tests.epp.factories import TEN_MIB, CountingTokenizer

MAX_MODEL_LEN = 2048
# vLLM 0.32's answer to a 2,400-token prompt on a 2,048-token context (tests/fixtures/vllm-0.32).
VLLM_AT_LEAST = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
    "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
    "of the input prompt. (parameter=input_tokens, value=2049)"
)


TOKENIZER = CountingTokenizer()


def refusal(text: str, max_model_len: int = MAX_MODEL_LEN) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        encode_prompt(text, TOKENIZER, max_model_len)
    return info.value


def test_a_text_no_tokenization_can_fit_is_refused_untokenized() -> None:
    TOKENIZER.encoded.clear()
    error = refusal("x" * TEN_MIB)
    limit = MAX_MODEL_LEN * TOKENIZER.max_chars_per_token
    assert error.message == (
        f"This model's maximum context length is 2048 tokens. However, your prompt contains {TEN_MIB} "
        f"characters (more than {limit} characters, which is the upper bound for 2048 input tokens). "
        f"Please reduce the length of the input prompt. (parameter=input_text, value={TEN_MIB})"
    )
    assert error.param == "input_text" and TOKENIZER.encoded == []


def test_a_long_text_within_that_bound_is_refused_from_a_prefix() -> None:
    text = "hello world " * 6000  # 72,000 characters, 12,000 tokens: under the character bound
    assert len(text) <= MAX_MODEL_LEN * TOKENIZER.max_chars_per_token
    TOKENIZER.encoded.clear()
    error = refusal(text)
    assert (error.message, error.param) == (VLLM_AT_LEAST, "input_tokens")
    assert TOKENIZER.encoded and max(TOKENIZER.encoded) < len(text) / 3


def test_a_text_over_the_limit_but_under_the_probe_is_refused_after_tokenizing() -> None:
    text = "hello world " * 700  # 2,100 tokens in 8,400 characters
    assert len(TOKENIZER.encode(text)) > MAX_MODEL_LEN
    assert refusal(text).message == VLLM_AT_LEAST


def test_long_prompts_that_fit_get_exactly_their_tokens() -> None:
    # ~16 characters a token: longer than the first probe, yet within the context.
    text = ("." + " " * 32) * 900
    TOKENIZER.encoded.clear()
    ids = encode_prompt(text, TOKENIZER, MAX_MODEL_LEN)
    assert TOKENIZER.encoded[0] < len(text) == TOKENIZER.encoded[-1]  # probed, then tokenized whole
    assert ids == TOKENIZER.encode(text) and 1500 <= len(ids) <= MAX_MODEL_LEN
    assert encode_prompt(text, TOKENIZER, None) == ids


@pytest.mark.parametrize(("count", "shown"), [(2049, "at least 2049"), (3000, "3000")])
def test_token_ids_over_the_context_are_refused_in_vllms_words(count: int, shown: str) -> None:
    check_token_ids([5] * MAX_MODEL_LEN, MAX_MODEL_LEN)
    check_token_ids([5] * count, None)
    with pytest.raises(BadRequest) as info:
        check_token_ids([5] * count, MAX_MODEL_LEN)
    assert f"your prompt contains {shown} input tokens" in info.value.message
    assert info.value.message.endswith(f"(parameter=input_tokens, value={count})")


def vllm_reference(text: str, max_model_len: int) -> list[int] | str:
    """What vLLM does: the character bound, then the whole text tokenized and counted."""
    if len(text) > max_model_len * TOKENIZER.max_chars_per_token:
        return "input_text"
    ids = ModelTokenizer.encode(TOKENIZER, text)
    return ids if len(ids) <= max_model_len else "input_tokens"


WORDS = st.lists(
    st.one_of(
        st.sampled_from([" ", "  ", "\n", "\t", "hello", "'s", "123", "#", "..", "\u00a0", "é", "日本"]),
        st.text(max_size=6),
    ),
    max_size=120,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=WORDS)
def test_a_prefix_cut_where_a_word_starts_tokenizes_to_a_prefix_of_the_tokens(text: str) -> None:
    whole = TOKENIZER.encode(text)
    cut = word_start(text, 0)
    while cut is not None:
        prefix = TOKENIZER.encode(text[:cut])
        assert whole[: len(prefix)] == prefix
        assert not text[cut - 1].isspace() and text[cut] == " "
        cut = word_start(text, cut + 1)


@settings(max_examples=300, deadline=None)
@given(text=WORDS, max_model_len=st.integers(1, 40))
def test_refusals_and_token_ids_are_vllms_for_any_text(text: str, max_model_len: int) -> None:
    # Small contexts make the probe run on short texts, so any cut that changed the tokens shows.
    try:
        outcome: list[int] | str = encode_prompt(text, TOKENIZER, max_model_len)
    except BadRequest as error:
        outcome = str(error.param)
    assert outcome == vllm_reference(text, max_model_len)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hello world " * (TEN_MIB // 12)}),
        ("/v1/completions", {"model": "tiny", "prompt": ["hello world " * (TEN_MIB // 12), "x"]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * TEN_MIB}]}),
    ],
)
def test_a_10_mib_prompt_is_a_400_without_tokenizing_it(path: str, body: dict) -> None:
    raw = json.dumps(body).encode()
    TOKENIZER.encoded.clear()
    with pytest.raises(BadRequest) as info:
        parse_openai_request(path, {}, raw, TOKENIZER, "rid", max_model_len=MAX_MODEL_LEN)
    assert info.value.param == "input_text" and TOKENIZER.encoded == []
