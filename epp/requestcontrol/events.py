"""What a request's routing tells its driver as it goes: :meth:`RequestHandle.schedule`'s events.

A driver (the ext_proc stream, the ext_authz check) iterates them and answers its own peer:
the ext_proc stream extends Envoy's message timeout while the request is :class:`Held`, and
forwards it once :class:`Routed`, which always comes last (or a ``RequestError`` is raised).
"""

from __future__ import annotations

from dataclasses import dataclass

from epp.scheduling.types import SchedulingResult


@dataclass(frozen=True, slots=True)
class Held:
    """Flow control holds the request while the pool is saturated."""

    max_wait_s: float
    """The most it may wait before it is dispatched or shed (its band's TTL, seconds)."""


@dataclass(frozen=True, slots=True)
class Routed:
    """The scheduler picked the request's endpoints, and the request is booked there."""

    result: SchedulingResult


RequestEvent = Held | Routed
