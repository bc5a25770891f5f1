"""Token ids estimated from the text, for an EPP that cannot have the served model's tokenizer.

Every ``BYTES_PER_TOKEN`` bytes of the prompt's UTF-8 text count as one token, and that token's
id is those bytes read as a big-endian integer (the last run zero-padded; a run of over 4 bytes
folded to 32 bits). The ratio may be any other up to
``MAX_BYTES_PER_TOKEN`` (``epp.tokenizer.sampling`` measures the served model's on the prompts it
tokenizes): run k is then bytes ``floor(k r)`` to ``floor((k + 1) r)``, so the runs keep to fixed
offsets from the start of the text. Why this estimate:

* The count: the byte-level BPE vocabularies of current models (Llama 3, Qwen, Mistral, GPT)
  average about 4 bytes a token on English prose and a little less on code, so counts are
  usually within a quarter of the engine's; scripts of 2-3 bytes a character (CJK) count high.
  The latency model and token-load accounting only need the scale right, and read the same
  estimate for every request.
* The prefix: the id of a run depends on that run's bytes alone, so two prompts that share
  their first n bytes share their first n // 4 ids, and the EPP's prefix-block hashes of the
  shared part agree: prefix affinity (the approximate prefix index) keeps working. A
  tokenizer-free scheme that cut at words instead would not count any better without knowing
  the vocabulary, and fixed runs cost a few passes of ``numpy`` (~25 µs for 1.8 kB).

What it loses: the ids are not the engine's, so KV-event (precise) prefix matching finds
nothing, and no prompt is refused for its length (the engine refuses it; see
``EstimatedTokenizer.exact``). docs/tokenizer.md measures what routing on estimates costs.

Chat messages are rendered by a generic template (each message as its role and its text),
since the model's own template comes with its tokenizer: the same conversation prefix gives
the same text prefix, which is all the estimate needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from epp.tokenizer.cache import TokenizerCache, check_inline
from epp.tokenizer.model import normalise_messages

BYTES_PER_TOKEN = 4
MAX_BYTES_PER_TOKEN = 8
"""A run's bytes fit one 64-bit word, folded to a 32-bit id."""
_WORDS = {4: np.dtype(">u4"), 8: np.dtype(">u8")}
"""Runs of up to 4 bytes are read as 32-bit words, longer ones as 64-bit words."""


def estimated_ids(data: bytes, bytes_per_token: float = BYTES_PER_TOKEN) -> list[int]:
    """The estimated token ids of UTF-8 ``data``: one per ``bytes_per_token`` bytes, begun (see
    the module); ``bytes_per_token`` in [1, ``MAX_BYTES_PER_TOKEN``]."""
    if not 1 <= bytes_per_token <= MAX_BYTES_PER_TOKEN:
        raise ValueError(f"bytes per token must be in [1, {MAX_BYTES_PER_TOKEN}], got {bytes_per_token}")
    count = math.ceil(len(data) / bytes_per_token)
    bounds = np.floor(np.arange(count + 1) * bytes_per_token).astype(np.int64)
    np.minimum(bounds, len(data), out=bounds)
    longest = math.ceil(bytes_per_token)
    width = 4 if longest <= 4 else 8
    lanes = np.arange(width)
    padded = np.frombuffer(data + bytes(width), dtype=np.uint8)
    # Each run's bytes, from the top of a word, the rest of the word zero.
    runs = padded[bounds[:-1, None] + lanes] * (np.diff(bounds)[:, None] > lanes)
    word = _WORDS[width]
    # Shifted down, at 4 bytes a token each id is its run read as an integer. Ids are 32-bit,
    # as a vocabulary's are (the prefix index packs them so): a longer run's top bytes are
    # folded onto its bottom four.
    values = runs.view(word).ravel() >> word.type(8 * (width - longest))
    if width == 8:
        values = (values ^ (values >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    return values.tolist()


def utf8(text: str) -> bytes:
    """``text``'s UTF-8 bytes; a lone surrogate (which JSON can carry) is kept as its bytes, not refused."""
    return text.encode("utf-8", "surrogatepass")


class EstimatedTokenizer:
    """Implements ``epp.tokenizer.model.PromptTokenizer`` without a vocabulary (see the module)."""

    exact = False
    cache: TokenizerCache | None = None
    max_chars_per_token = BYTES_PER_TOKEN
    """A run of BYTES_PER_TOKEN bytes holds at most that many characters."""

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        """The estimated ids of ``text``; ``TooLongToInline`` past ``max_chars`` characters."""
        check_inline(len(text), max_chars)
        return estimated_ids(utf8(text))

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in normalise_messages(messages))
        return rendered + ("<|assistant|>\n" if add_generation_prompt else "")
