"""Refuse prompts longer than the model's context, as vLLM 0.32 does, without tokenizing all of them.

vLLM refuses a text prompt in two steps, and this module gives the same answers (message, param):

1. untokenized, a text of more characters than ``max_model_len`` of the vocabulary's longest
   tokens: no tokenization of it can fit (``input_text``);
2. tokenized with truncation at ``max_model_len + 1`` tokens, a text of more tokens than
   ``max_model_len``: vLLM says "at least max_model_len + 1" (``input_tokens``).

vLLM's tokenizer still reads the whole text before truncating, so a 10 MiB prompt under the first
bound costs seconds of CPU. Here a long text is probed first: a prefix that ends where a word
starts (before a space that follows a non-space) is tokenized, and the prefix grows until it holds
more than ``max_model_len`` tokens or is the whole text. Pre-tokenizers split text into words
before merging (byte-level BPE, Metaspace, WordPiece: none merges across a non-space then a
space), so such a prefix tokenizes to a prefix of the whole text's tokens, and a prefix over the
limit proves the whole text is over it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from epp.errors import BadRequest
from epp.tokenizer.model import PromptTokenizer

# The first probe is this many characters per allowed token: above the ~4 of natural language,
# so a prompt that fits is rarely probed before its full tokenization.
PROBE_CHARS_PER_TOKEN = 8
_WORD_START = re.compile(r"\S ")


def word_start(text: str, at: int) -> int | None:
    """The first cut at or after ``at`` between a non-space character and a space (None if there
    is none): where pre-tokenizers start a word, so ``text[:cut]`` tokenizes to a prefix of
    ``text``'s tokens."""
    found = _WORD_START.search(text, max(0, at - 1))
    return found.start() + 1 if found else None


def _too_long(max_model_len: int, detail: str, parameter: str, value: int) -> BadRequest:
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{detail}. Please reduce the length of the input prompt. (parameter={parameter}, value={value})",
        param=parameter,
    )


def too_many_tokens(count: int, max_model_len: int) -> BadRequest:
    """vLLM's refusal of a prompt of ``count`` tokens, "at least" when it is the truncated count."""
    qualifier = "at least " if count == max_model_len + 1 else ""
    detail = f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens"
    return _too_long(max_model_len, detail, "input_tokens", count)


def check_token_ids(token_ids: Sequence[int], max_model_len: int | None) -> None:
    """Raise :class:`BadRequest` if a prompt given as token ids is longer than the context."""
    if max_model_len is not None and len(token_ids) > max_model_len:
        raise too_many_tokens(len(token_ids), max_model_len)


def encode_prompt(
    text: str, tokenizer: PromptTokenizer, max_model_len: int | None, max_chars: int | None = None
) -> list[int]:
    """The token ids of a text prompt; raise :class:`BadRequest` if it cannot fit ``max_model_len``
    tokens (None: unknown, nothing is refused). A text over the limit is tokenized only in prefixes:
    the first of ``(max_model_len + 1) * PROBE_CHARS_PER_TOKEN`` characters, each next one twice as
    long, until one holds more than ``max_model_len`` tokens. ``max_chars``: as in
    :meth:`ModelTokenizer.encode`, for each tokenization."""
    if max_model_len is None:
        return tokenizer.encode(text, max_chars)
    max_chars = max_model_len * tokenizer.max_chars_per_token
    if len(text) > max_chars:
        detail = (
            f"{len(text)} characters (more than {max_chars} characters, which is the upper bound for "
            f"{max_model_len} input tokens)"
        )
        raise _too_long(max_model_len, detail, "input_text", len(text))
    over_limit = too_many_tokens(max_model_len + 1, max_model_len)
    probe = (max_model_len + 1) * PROBE_CHARS_PER_TOKEN
    while probe < len(text) and (cut := word_start(text, probe)) is not None:
        if len(tokenizer.encode(text[:cut], max_chars)) > max_model_len:
            raise over_limit
        probe = 2 * cut
    token_ids = tokenizer.encode(text, max_chars)
    if len(token_ids) > max_model_len:
        raise over_limit
    return token_ids
