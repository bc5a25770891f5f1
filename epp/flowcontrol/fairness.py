"""Fairness policies: which flow (tenant) of a band sends its next request.

A policy sees the band's non-empty flows in the order they became non-empty and names one;
the controller then tells it what that flow was charged. Policies keep their own state per
band, so bands never affect each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pydantic import BaseModel

from epp.scheduling.framework import Plugin, PluginContext
from epp.scheduling.registry import register


class FairnessPolicy(Plugin, ABC):
    @abstractmethod
    def pick(self, band: int, flows: Sequence[str]) -> str:
        """One of ``flows`` (non-empty, each with a queued request) to dispatch from next."""

    def activated(self, band: int, flow: str) -> None:
        """``flow`` had nothing queued in ``band`` and now has a request."""

    def charged(self, band: int, flow: str, tokens: int) -> None:
        """A request of ``flow`` booking ``tokens`` was dispatched."""


@register
class RoundRobinFairness(FairnessPolicy):
    """Flows take turns, one request each, whatever its size."""

    type_name = "round-robin-fairness"

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        # Per band: flows by when they were last served, least recent first.
        self._turns: dict[int, dict[str, None]] = {}

    def pick(self, band: int, flows: Sequence[str]) -> str:
        turns = self._turns.setdefault(band, {})
        waiting = set(flows)
        never_served = next((f for f in flows if f not in turns), None)
        if never_served is not None:
            return never_served
        return next(f for f in turns if f in waiting)

    def charged(self, band: int, flow: str, tokens: int) -> None:
        turns = self._turns.setdefault(band, {})
        turns.pop(flow, None)
        turns[flow] = None


@register
class LeastAttainedServiceFairness(FairnessPolicy):
    """The flow that was served the fewest tokens goes next, so a tenant of long prompts cannot
    crowd out one of short chats. A flow that comes back after being idle starts level with the
    least-served waiting flow, not with its old (lower) count, so idling earns no credit."""

    type_name = "least-attained-service-fairness"

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._attained: dict[int, dict[str, int]] = {}
        self._active: dict[int, set[str]] = {}

    def pick(self, band: int, flows: Sequence[str]) -> str:
        attained = self._attained.setdefault(band, {})
        self._active[band] = set(flows)
        return min(flows, key=lambda f: attained.get(f, 0))

    def activated(self, band: int, flow: str) -> None:
        attained = self._attained.setdefault(band, {})
        others = [attained.get(f, 0) for f in self._active.get(band, ()) if f != flow]
        if others:
            attained[flow] = max(attained.get(flow, 0), min(others))

    def charged(self, band: int, flow: str, tokens: int) -> None:
        attained = self._attained.setdefault(band, {})
        attained[flow] = attained.get(flow, 0) + tokens

    def attained(self, band: int, flow: str) -> int:
        return self._attained.get(band, {}).get(flow, 0)
