"""Token ids estimated from the text, for an EPP that cannot have the served model's tokenizer.

Every ``BYTES_PER_TOKEN`` bytes of the prompt's UTF-8 text count as one token, and that token's
id is those bytes read as a big-endian integer (the last run zero-padded). Why this estimate:

* The count: the byte-level BPE vocabularies of current models (Llama 3, Qwen, Mistral, GPT)
  average about 4 bytes a token on English prose and a little less on code, so counts are
  usually within a quarter of the engine's; scripts of 2-3 bytes a character (CJK) count high.
  The latency model and token-load accounting only need the scale right, and read the same
  estimate for every request.
* The prefix: the id of a run depends on that run's bytes alone, so two prompts that share
  their first n bytes share their first n // 4 ids, and the EPP's prefix-block hashes of the
  shared part agree: prefix affinity (the approximate prefix index) keeps working. A
  tokenizer-free scheme that cut at words instead would not count any better without knowing
  the vocabulary, and fixed runs cost one pass of ``numpy``.

What it loses: the ids are not the engine's, so KV-event (precise) prefix matching finds
nothing, and no prompt is refused for its length (the engine refuses it; see
``EstimatedTokenizer.exact``). docs/tokenizer.md measures what routing on estimates costs.

Chat messages are rendered by a generic template (each message as its role and its text),
since the model's own template comes with its tokenizer: the same conversation prefix gives
the same text prefix, which is all the estimate needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from epp.tokenization import normalise_messages
from epp.tokenizer_cache import TokenizerCache, check_inline

BYTES_PER_TOKEN = 4
_RUN = np.dtype(">u4")  # one run of BYTES_PER_TOKEN bytes


def estimated_ids(data: bytes) -> list[int]:
    """The estimated token ids of UTF-8 ``data``: one per ``BYTES_PER_TOKEN`` bytes, begun."""
    padded = data + b"\0" * (-len(data) % BYTES_PER_TOKEN)
    return np.frombuffer(padded, dtype=_RUN).tolist()


class EstimatedTokenizer:
    """Implements ``epp.tokenization.PromptTokenizer`` without a vocabulary (see the module)."""

    exact = False
    cache: TokenizerCache | None = None
    max_chars_per_token = BYTES_PER_TOKEN
    """A run of BYTES_PER_TOKEN bytes holds at most that many characters."""

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        """The estimated ids of ``text``; ``TooLongToInline`` past ``max_chars`` characters."""
        check_inline(len(text), max_chars)
        # A lone surrogate (which JSON can carry) is kept as its own bytes, not refused.
        return estimated_ids(text.encode("utf-8", "surrogatepass"))

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in normalise_messages(messages))
        return rendered + ("<|assistant|>\n" if add_generation_prompt else "")
