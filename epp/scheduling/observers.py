"""The one interface that follows a routed request: :class:`LifecycleObserver`.

The request lifecycle (``epp.requestcontrol.lifecycle``) calls, at each step, every observer
that overrides it, with the :class:`RoutedRequest` it follows: first the pipeline's plugins that
are observers (token-load bookings, training samples, endpoint speeds), then the lifecycle's
own (the live EPP's request metrics, its prediction report ``epp.latency.report``, the
active-active replica sync ``epp.sync.hook``), in the order given. An observer that needs a new
step adds it here and in the lifecycle, nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult


@dataclass(slots=True)
class RoutedRequest:
    """A request the lifecycle routed, and what it learned about it since; times are the driver's."""

    request: LLMRequest
    result: SchedulingResult
    state: CycleState
    booked: EndpointState
    """Where the request is counted in flight."""
    received_at: float
    first_token_at: float | None = None
    outcome: RequestOutcome | None = None
    """Set when the lifecycle hears that the request finished."""

    @property
    def endpoint_name(self) -> str:
        return self.booked.endpoint.name


class LifecycleObserver:
    """Follows every routed request. Override the steps you need; each is a no-op here (and the
    lifecycle does not call it)."""

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        """The request was scheduled and booked; it is about to be forwarded."""

    def on_rebooked(self, routed: RoutedRequest, previous: EndpointState, now: float) -> None:
        """The request was served by another endpoint than the one it was booked on (the
        gateway retried it elsewhere): ``routed.booked`` is now the endpoint that serves it."""

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        """The first output token reached the gateway."""

    def on_progress(self, routed: RoutedRequest, tokens: int, now: float) -> None:
        """``tokens`` output tokens have streamed so far."""

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        """The request is over (``outcome.completed`` says whether it ended normally: completed,
        failed upstream, or cancelled by the client)."""

    def upstream_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        """Headers to add to the request forwarded to the endpoint (a trace context)."""
        return {}

    def debug_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        """Response headers for a request that asked for the routing decision (``x-llm-epp-debug``)."""
        return {}
