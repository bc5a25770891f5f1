"""Streamed completions timed at the client, and prompt texts of a chosen length, for the tiny model.

``stream_completion`` sends one streamed ``/v1/completions`` request (``ignore_eos``, so the
output length is exact) and times it: TTFT to the first token's event, TPOT as the time from the
first to the last token over the tokens in between. vLLM merges the tokens of several steps into
one event when its API server falls behind, so events are not counted: the output length comes
from the usage chunk.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from sim.openai_serving import ServedModel


class CompletionError(RuntimeError):
    """A streamed completion failed or ended without its usage chunk."""


@dataclass(frozen=True, slots=True)
class StreamedCompletion:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None
    """Seconds per output token after the first; None for a one-token output."""


def completion_body(prompt: str | list[int], max_tokens: int) -> dict[str, object]:
    """A streamed, exact-length completion request for the served tiny model."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, prompt: str | list[int], max_tokens: int
) -> StreamedCompletion:
    """Send one streamed completion and time it; raises CompletionError unless it succeeds."""
    first = last = None
    usage: dict[str, int] | None = None
    start = time.perf_counter()
    async with session.post(
        f"{base_url}/v1/completions", json=completion_body(prompt, max_tokens)
    ) as response:
        if response.status != 200:
            raise CompletionError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue  # blank separators and [DONE]
            event = json.loads(line[6:])
            if event.get("choices"):
                last = time.perf_counter()
                first = first or last
            usage = event.get("usage") or usage
    if first is None or last is None or usage is None:
        raise CompletionError("the stream ended without tokens or usage")
    output_tokens = usage["completion_tokens"]
    return StreamedCompletion(
        prompt_tokens=usage["prompt_tokens"],
        output_tokens=output_tokens,
        ttft_s=first - start,
        tpot_s=(last - first) / (output_tokens - 1) if output_tokens > 1 else None,
    )


class PromptMaker:
    """Random texts that the tiny model's tokenizer splits into a chosen number of tokens.

    The texts join random ASCII vocabulary entries, so no two share a prefix block and neither
    prefix caching nor multi-byte characters blur the count. Same seed, same texts.
    """

    def __init__(self, seed: int, model_dir: Path = TINY_MODEL_DIR) -> None:
        self._tokenizer = ModelTokenizer(model_dir)
        self._model = ServedModel(self._tokenizer, "tiny", str(model_dir))
        self._vocab = [t for t in self._model.output_vocab if self._model.token_texts[t].isascii()]
        self._rng = random.Random(seed)

    def text(self, num_tokens: int) -> str:
        """A text of ``num_tokens`` tokens (re-tokenizing a cut text may merge one token more or less)."""
        pieces = self._model.text(self._rng.choices(self._vocab, k=num_tokens))
        return self._tokenizer.decode(self._tokenizer.encode(pieces)[:num_tokens])
