"""Builders for flow-control tests: requests, a controller, and a detector the test sets."""

from __future__ import annotations

import itertools

from epp.flowcontrol.controller import BandLimits, FlowController, FlowSettings
from epp.flowcontrol.fairness import FairnessPolicy, RoundRobinFairness
from epp.flowcontrol.ordering import FcfsOrdering, OrderingPolicy
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.types import FlowRequest, PoolView
from epp.scheduling.framework import NoParameters, PluginContext

_keys = itertools.count(1)
DEFAULT_LIMITS = BandLimits()
CONTEXT = PluginContext(clock=lambda: 0.0)


class CapacityDetector(SaturationDetector):
    """Room while fewer than ``capacity`` dispatched requests are unfinished (the test's stand-in
    for a pool; the shipped detectors have their own tests)."""

    type_name = "test-capacity"

    def __init__(self, capacity: int) -> None:
        super().__init__(self.type_name, NoParameters(), CONTEXT)
        self.capacity = capacity

    def saturated(self, pool: PoolView, head: FlowRequest) -> bool:
        booked = pool.pending_requests + sum(len(t) for t in pool.routed_at.values())
        return booked >= self.capacity


def policy(cls: type, **params: object) -> object:
    return cls(cls.type_name, cls.Parameters.model_validate(params), CONTEXT)


def request(
    band: int = 0, flow: str = "a", tokens: int = 100, received_at: float = 0.0, slo_ms: float | None = None
) -> FlowRequest:
    return FlowRequest(next(_keys), band, flow, tokens, received_at, slo_ms)


def controller(
    capacity: int = 0,
    *,
    fairness: type[FairnessPolicy] = RoundRobinFairness,
    ordering: type[OrderingPolicy] = FcfsOrdering,
    bands: dict[int, BandLimits] | None = None,
    default: BandLimits = DEFAULT_LIMITS,
    max_queued: int = 5000,
) -> tuple[FlowController, CapacityDetector]:
    detector = CapacityDetector(capacity)
    settings = FlowSettings(bands or {}, default, max_queued)
    return FlowController(settings, policy(fairness), policy(ordering), [detector]), detector  # type: ignore[arg-type]
