"""What a live replay sends: a fleet workload's sessions as chat prompts in text, with their times.

The traces carry token counts and prefix identity (hash ids, session history), not text. Every
piece of a prompt here is a run of the tokenizer's single-token words (`` the``, `` self``, ...),
chosen by the keyed generator that gives the fleet simulator its tokens (``sim.fleet.prompts``):
the same key always gives the same words, and the words never merge with their neighbours, so
N words are N tokens and a shared run of keys is a shared token prefix, for the EPP and the
engines alike.

* ``blocks`` turns (Mooncake): one user message, the words of each hash block in order, cut to
  length; requests that share leading hash ids share that prefix.
* ``previous`` turns (agent sessions): the previous turn's messages, its answer, and a new user
  message; each turn's rendered prompt extends the previous one's. The answer in the history is
  a stand-in keyed by the turn, so that every config is sent the same prompts, as long as the
  engine was told to generate (``ignore_eos``), or cut to what the trace's prompt grew by.
* ``none`` turns: a conversation of one user message.

Prompts are sized so that the rendered chat prompt (template included) has the turn's
``input_tokens``; where the template leaves less room than the trace asks for, the new message
keeps one word. A history that would no longer fit the model's window starts afresh (compaction).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epp.tokenizer.model import ModelTokenizer
from sim.fleet.prompts import synthetic_blocks, synthetic_tokens, turn_key
from sim.fleet.workload import Turn, Workload

_ANSWER_KEY = 1 << 60
"""Marks the key of a turn's stand-in answer (turn keys stay below 2**56)."""
_WORD = re.compile(r" [a-z]+")


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    index: int
    messages: tuple[str, ...]
    """Message contents; roles alternate, starting with ``user`` (so the last one is ``user``)."""
    prompt_tokens: int
    """Tokens of the rendered chat prompt, generation prompt included."""
    output_tokens: int
    offset_s: float | None
    """Seconds after the session's start (open loop), or None: ``think_s`` after the previous answer."""
    think_s: float

    def chat_messages(self) -> list[dict[str, str]]:
        return [
            {"role": "assistant" if i % 2 else "user", "content": content}
            for i, content in enumerate(self.messages)
        ]


@dataclass(frozen=True, slots=True)
class PlannedSession:
    session_id: str
    start_s: float
    turns: tuple[PlannedTurn, ...]
    group: str = ""
    after: str | None = None
    """A group whose sessions must all have ended before this one starts (``start_s`` after that)."""


class PromptTexts:
    """Texts of a chosen token length from integer keys, for one tokenizer and its chat template."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text) and tokenizer.encode(text) == [token_id]:
                words.append(text)
        if len(words) < 64:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; prompts need 64+")
        self._words = np.array(words, dtype=object)
        one = len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": words[0]}])))
        two = len(
            tokenizer.encode(
                tokenizer.render_chat(
                    [{"role": "user", "content": words[0]}, {"role": "assistant", "content": words[1]}]
                )
            )
        )
        self.message_overhead = two - one - 1
        """Template tokens around each message."""
        self.prompt_overhead = one - self.message_overhead - 1
        """Template tokens once per prompt (the generation prompt)."""

    def words(self, key: int, count: int) -> str:
        """``count`` single-token words determined by ``key``."""
        return self._join(synthetic_tokens(key, count))

    def blocks(self, hash_ids: Sequence[int], count: int, block_tokens: int) -> str:
        """The words of the blocks named by ``hash_ids`` (``block_tokens`` each), cut to ``count``."""
        return self._join(synthetic_blocks(list(hash_ids), block_tokens).reshape(-1)[:count])

    def chat_tokens(self, word_counts: Sequence[int]) -> int:
        """Tokens of a rendered chat prompt whose messages have these many words."""
        return self.prompt_overhead + sum(word_counts) + self.message_overhead * len(word_counts)

    def _join(self, keys: np.ndarray) -> str:
        return "".join(self._words[keys % len(self._words)])


def plan_sessions(workload: Workload, texts: PromptTexts, max_model_len: int) -> list[PlannedSession]:
    """Every session of ``workload`` as chat prompts (see the module docstring)."""
    return [
        PlannedSession(
            session.session_id,
            session.start_s,
            _plan_turns(session.session_id, session.turns, workload.hash_block_tokens, texts, max_model_len),
            session.group,
            session.after,
        )
        for session in workload.sessions
    ]


def _plan_turns(
    session_id: str, turns: Sequence[Turn], block_tokens: int, texts: PromptTexts, max_model_len: int
) -> tuple[PlannedTurn, ...]:
    planned: list[PlannedTurn] = []
    counts: tuple[int, ...] = ()
    single = texts.chat_tokens([0])
    for index, turn in enumerate(turns):
        key = turn_key(session_id, index)
        messages: tuple[str, ...] | None = None
        if turn.prefix == "previous" and planned:
            previous = planned[-1]
            room = turn.input_tokens - texts.chat_tokens([*counts, 0, 0])  # words for answer + new
            answer = min(previous.output_tokens, max(1, room - 1))
            new = max(1, room - answer)
            if texts.chat_tokens([*counts, answer, new]) + turn.output_tokens <= max_model_len:
                answer_key = turn_key(session_id, index - 1) | _ANSWER_KEY
                messages = (*previous.messages, texts.words(answer_key, answer), texts.words(key, new))
                counts = (*counts, answer, new)
        if messages is None:
            length = max(1, min(turn.input_tokens, max_model_len - turn.output_tokens) - single)
            if turn.prefix == "blocks":
                messages = (texts.blocks(turn.hash_ids, length, block_tokens),)
            else:
                messages = (texts.words(key, length),)
            counts = (length,)
        planned.append(
            PlannedTurn(
                index, messages, texts.chat_tokens(counts), turn.output_tokens, turn.offset_s, turn.think_s
            )
        )
    return tuple(planned)
