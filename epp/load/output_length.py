"""How long a request's answer is expected to be: the client's hint, else what its session said before.

Nobody knows an answer's length before it is generated, and the routers that book output work
(token load) or predict end-to-end time need one. Two sources are better than the ``max_tokens``
ceiling or a fixed ratio to the prompt:

* the client's hint (``x-expected-output-tokens``, ``epp.requestcontrol.request_headers``);
* the request's session (a chat, an agent loop, an RL rollout): its earlier turns' answers.
  :class:`SessionOutputLengths` keeps, per session key, the exponentially weighted mean of its
  completed turns' output tokens, and the same mean over every completed turn of the pool, for
  the first turn of a session it has not seen.

Pure and bounded: no clock is read (each call is given the time), at most ``capacity`` sessions
are kept (the least recently updated is forgotten first) and a session not updated for ``ttl_s``
seconds counts as unknown.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class OutputSource(StrEnum):
    HINT = "hint"
    """The client's ``x-expected-output-tokens``."""
    SESSION = "session"
    """The mean of the session's earlier answers."""
    POOL = "pool"
    """The mean of every earlier answer (a session's first turn)."""
    DEFAULT = "default"
    """``max_tokens``, or a ratio of the prompt: no estimate."""


class ExpectedOutput(NamedTuple):
    tokens: int
    source: OutputSource

    @property
    def estimated(self) -> bool:
        """From a hint or learned answers, not the ``max_tokens``/ratio default."""
        return self.source is not OutputSource.DEFAULT


@dataclass(slots=True)
class _Mean:
    value: float
    updated_at: float


class SessionOutputLengths:
    """Exponentially weighted mean output tokens per session and over the pool.

    The newest answer weighs ``1 − 2^(−1/half_life)``: after ``half_life`` turns the earlier ones
    weigh half. A session's first answer is its mean."""

    def __init__(self, half_life: float = 2.0, capacity: int = 100_000, ttl_s: float = 3600.0) -> None:
        if half_life <= 0 or capacity < 1 or ttl_s <= 0:
            raise ValueError("half_life and ttl_s must be positive, capacity at least 1")
        self.alpha = 1.0 - math.pow(2.0, -1.0 / half_life)
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, _Mean] = OrderedDict()
        self._pool: float | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def observe(self, session: str | None, output_tokens: int, now: float) -> None:
        """A turn of ``session`` (None: no session key) completed with ``output_tokens``."""
        if output_tokens < 1:
            return
        self._pool = self._blend(self._pool, output_tokens)
        if session is None:
            return
        mean = self._sessions.pop(session, None)
        if mean is not None and now - mean.updated_at > self.ttl_s:
            mean = None
        self._sessions[session] = _Mean(self._blend(mean.value if mean else None, output_tokens), now)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def _blend(self, mean: float | None, value: int) -> float:
        return float(value) if mean is None else mean + self.alpha * (value - mean)

    def session_mean(self, session: str | None, now: float) -> float | None:
        """The session's mean answer, or None if unknown (never seen, forgotten, or expired)."""
        mean = self._sessions.get(session) if session is not None else None
        if mean is None or now - mean.updated_at > self.ttl_s:
            return None
        return mean.value

    def expected(self, session: str | None, now: float) -> ExpectedOutput | None:
        """The session's mean, else the pool's, rounded to whole tokens; None before any answer."""
        mean = self.session_mean(session, now)
        if mean is not None:
            return ExpectedOutput(max(1, round(mean)), OutputSource.SESSION)
        if self._pool is None:
            return None
        return ExpectedOutput(max(1, round(self._pool)), OutputSource.POOL)
