"""What the fleet simulator replays: sessions of turns, each turn one request.

A turn's prompt is one of

* ``none``: ``input_tokens`` fresh tokens, shared with nothing;
* ``previous``: the session's previous turn as the engine left it (its prompt and the tokens it
  actually generated), then fresh tokens up to ``input_tokens`` (or that sequence cut to
  ``input_tokens`` when it is longer): a chat or agent history that grows turn by turn;
* ``blocks``: the token blocks named by ``hash_ids`` (``Workload.hash_block_tokens`` tokens each,
  the same id always the same tokens), cut to ``input_tokens``: prefix identity as the Mooncake
  traces record it.

A turn arrives ``offset_s`` after its session's start (open loop: recorded times), or, when
``offset_s`` is None, ``think_s`` after the session's previous turn finished (closed loop: a user
or an agent waiting for the answer). A session's first turn arrives at ``start_s``, or, for a
session that waits for a group (``after``: an RL step's rollouts wait for the previous step),
``start_s`` after the last session of that group ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from epp.flowcontrol.types import FAIRNESS_ID_HEADER

PrefixMode = Literal["none", "previous", "blocks"]


@dataclass(frozen=True, slots=True)
class Turn:
    input_tokens: int
    output_tokens: int
    prefix: PrefixMode = "none"
    hash_ids: tuple[int, ...] = ()
    offset_s: float | None = None
    think_s: float = 0.0

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a turn needs at least one input and one output token: {self}")
        if self.prefix == "blocks" and not self.hash_ids:
            raise ValueError("a 'blocks' turn needs hash_ids")
        if self.think_s < 0 or (self.offset_s is not None and self.offset_s < 0):
            raise ValueError(f"negative time in {self}")


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    start_s: float
    turns: tuple[Turn, ...]
    group: str = ""
    """Sessions that finish together count as one unit (an RL step's rollouts), reported as such."""
    after: str | None = None
    """A group whose sessions must all have ended before this session starts."""
    tenant: str = ""
    """Sent as ``x-gateway-inference-fairness-id`` (flow control's flow) when given."""
    priority: int = 0
    slo_ttft_ms: float | None = None
    """This session's TTFT objective; None: the workload's."""


@dataclass(slots=True)
class Workload:
    name: str
    sessions: list[Session]
    description: str = ""
    hash_block_tokens: int = 512
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    max_tokens: int | None = None
    """``max_tokens`` the client sends (routers may read it; the engine generates the true length)."""
    params: dict[str, object] = field(default_factory=dict)
    """How the workload was built (trace, rate scale, seed, ...), for the report."""

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def min_think_s(self) -> float | None:
        """Shortest wait from a request's finish to an arrival it causes: a closed-loop turn's
        think time, or the start offset of a session that waits for a group. None when every
        arrival time is fixed."""
        thinks = [t.think_s for s in self.sessions for t in s.turns[1:] if t.offset_s is None]
        thinks += [s.start_s for s in self.sessions if s.after is not None]
        return min(thinks) if thinks else None


def session_headers(session: Session) -> dict[str, str]:
    """The request headers a session's turns carry besides its id: its tenant, if any."""
    return {FAIRNESS_ID_HEADER: session.tenant} if session.tenant else {}
