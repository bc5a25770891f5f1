"""Ordering policies: which request of a flow goes next. A policy maps a request to a sort key;
the smallest key is dispatched first (ties in arrival order)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from epp.flowcontrol.types import FlowRequest
from epp.scheduling.framework import Plugin
from epp.scheduling.registry import register


class OrderingPolicy(Plugin, ABC):
    @abstractmethod
    def key(self, request: FlowRequest) -> float:
        """Sort key, fixed for the request's life in the queue."""


@register
class FcfsOrdering(OrderingPolicy):
    """First come, first served."""

    type_name = "fcfs-ordering"

    def key(self, request: FlowRequest) -> float:
        return request.enqueued_at


@register
class EarliestDeadlineOrdering(OrderingPolicy):
    """Earliest TTFT deadline first (arrival + ``x-slo-ttft-ms``); requests without an objective
    come after every request with one, first come first served."""

    type_name = "earliest-deadline-ordering"

    def key(self, request: FlowRequest) -> float:
        return request.slo_deadline
