"""Watch an engine's response body go by: count generated tokens and find ``usage``.

Streaming responses are Server-Sent Events (``data: {json}`` lines, ending with
``data: [DONE]``). Every event whose choices carry new text counts as one token per choice
(vLLM sends one event per token); a ``usage`` object, sent last when the client asked for
``stream_options.include_usage``, gives the exact counts. Non-streaming responses are
buffered up to a limit and their ``usage`` read at the end. The meter never changes or holds
back the bytes it sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(prompt, completion, cached if isinstance(cached, int) else None)


def _tokens_in_event(event: dict[str, Any]) -> int:
    choices = event.get("choices")
    if not isinstance(choices, list):
        return 0
    tokens = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            tokens += 1
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            tokens += 1
    return tokens


class ResponseMeter:
    """Feed it the response body chunk by chunk; read ``tokens`` and ``usage`` as they appear."""

    def __init__(self, streaming: bool, max_buffered_bytes: int = 8 << 20) -> None:
        self.streaming = streaming
        self.max_buffered_bytes = max_buffered_bytes
        self.tokens = 0
        self.body_bytes = 0
        self.usage: Usage | None = None
        self.done = False
        self._pending = b""
        self._buffer: list[bytes] = []
        self._buffered = 0

    def feed(self, chunk: bytes) -> int:
        """Account for one body chunk; return how many new tokens it carried."""
        if not chunk:
            return 0
        self.body_bytes += len(chunk)
        if not self.streaming:
            self._buffered += len(chunk)
            if self._buffered <= self.max_buffered_bytes:
                self._buffer.append(chunk)
            return 0
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > self.max_buffered_bytes:
            self._pending = b""
        return sum(self._line(line) for line in lines)

    def _line(self, line: bytes) -> int:
        if not line.startswith(b"data:"):
            return 0
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return 0
        try:
            event = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return 0
        if not isinstance(event, dict):
            return 0
        usage = Usage.from_json(event.get("usage"))
        if usage is not None:
            self.usage = usage
        new = _tokens_in_event(event)
        self.tokens += new
        return new

    def finish(self) -> None:
        """The body ended: flush a final unterminated line, or parse the buffered JSON body."""
        if self.streaming:
            if self._pending:
                self._line(self._pending.rstrip(b"\r"))
                self._pending = b""
            return
        if self._buffered > self.max_buffered_bytes or not self._buffer:
            return
        try:
            body = json.loads(b"".join(self._buffer))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        if isinstance(body, dict):
            self.usage = Usage.from_json(body.get("usage"))
            if self.usage is not None:
                self.tokens = self.usage.completion_tokens

    @property
    def completion_tokens(self) -> int:
        """Exact count when the engine reported usage, else the tokens counted so far."""
        return self.usage.completion_tokens if self.usage is not None else self.tokens
