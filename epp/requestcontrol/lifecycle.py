"""One routed request's lifecycle around the scheduling core, the same for every driver.

A driver (the ext_proc director, ``epp.requestcontrol.director``; the fleet simulator's router,
``sim.fleet.routers``) parses or builds the :class:`LLMRequest`, then calls, with the time of
each step on its own clock:

1. :meth:`RequestLifecycle.route`: the pipeline picks the endpoint (its pre-request hooks book
   the request: token load, prefix index, TPOT SLOs), the request is counted in flight there,
   and the observers hear ``on_routed``;
2. :meth:`RequestLifecycle.rebooked` if the driver learns that another endpoint serves the
   request (the gateway retried it on a fallback), before any token;
3. :meth:`RequestLifecycle.first_token` when the first output token reaches the gateway;
4. :meth:`RequestLifecycle.progress` as output tokens stream (when anyone listens);
5. :meth:`RequestLifecycle.finished` exactly once, completed or not (a failed upstream, a client
   that went away, an engine's refusal).

This is the only place that builds a :class:`RequestOutcome` and calls the observers: one list
of :class:`LifecycleObserver`, the pipeline's observer plugins (token-load release, training
samples, prefix-index updates, SLO bookkeeping) first, then the lifecycle's own (the live
metrics, the prediction report, the active-active replica sync), in the order given; each step
calls only the observers that override it. No I/O happens here and no clock is read: each
step's time comes from the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.pipeline import Pipeline
from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult

ENDPOINT_HEADER = "x-llm-epp-endpoint"


class RequestLifecycle:
    """The lifecycle of every request routed by one pipeline (one EPP, or one EPP replica)."""

    def __init__(self, pipeline: Pipeline, observers: Sequence[LifecycleObserver] = ()) -> None:
        self.pipeline = pipeline
        self.observers: list[LifecycleObserver] = [*pipeline.observers, *observers]
        self._steps()

    def add_observer(self, observer: LifecycleObserver) -> None:
        """Follow every request from now on, after the observers already added."""
        self.observers.append(observer)
        self._steps()

    def _steps(self) -> None:
        # Each step's observers, those that override it: most observers follow a few steps only,
        # and a request's walk skips the others' no-op calls.
        def overriding(step: str) -> tuple[LifecycleObserver, ...]:
            default = getattr(LifecycleObserver, step)
            return tuple(o for o in self.observers if getattr(type(o), step) is not default)

        self._on_routed = overriding("on_routed")
        self._on_rebooked = overriding("on_rebooked")
        self._on_first_token = overriding("on_first_token")
        self._on_progress = overriding("on_progress")
        self._on_finished = overriding("on_finished")
        self._upstream_headers = overriding("upstream_headers")
        self._debug_headers = overriding("debug_headers")

    @property
    def wants_progress(self) -> bool:
        """Whether any observer does something with decode progress (drivers may skip the calls)."""
        return bool(self._on_progress)

    async def route(
        self, request: LLMRequest, candidates: Sequence[EndpointState], received_at: float, now: float
    ) -> RoutedRequest:
        """Schedule ``request`` on ``candidates`` and book it on the target. The pipeline's
        refusals propagate (``NoCandidates``, a ``RequestError``) with nothing booked."""
        # Steps that hold or refuse a request before it is scheduled (flow control) go here.
        state = CycleState()
        result = await self.pipeline.schedule(request, candidates, state)
        return self._book(request, result, state, candidates, received_at, now)

    def _book(
        self,
        request: LLMRequest,
        result: SchedulingResult,
        state: CycleState,
        candidates: Sequence[EndpointState],
        received_at: float,
        now: float,
    ) -> RoutedRequest:
        """Count the request in flight on the target ``result`` picked among ``candidates``."""
        name = result.endpoint.name
        booked = next(c for c in candidates if c.endpoint.name == name)
        booked.in_flight += 1
        routed = RoutedRequest(request, result, state, booked, received_at)
        for observer in self._on_routed:
            observer.on_routed(routed, now)
        return routed

    def rebooked(self, routed: RoutedRequest, actual: EndpointState, now: float) -> None:
        """``actual`` serves the request, not the endpoint it was booked on: the first booking
        ends unserved for the plugins (their ``on_finished`` with an outcome that did not
        complete: token load released, no training sample), the pre-request hooks book it on
        ``actual`` (its producers' data for ``actual`` is in the cycle state already), and the
        in-flight count moves. Nothing happens once a token arrived or the request finished."""
        previous = routed.booked
        if actual is previous or routed.first_token_at is not None or routed.outcome is not None:
            return
        unserved = RequestOutcome(
            endpoint=routed.result.endpoint,
            received_at=routed.received_at,
            finished_at=now,
            status=None,
            streaming=False,
            completed=False,
            first_token_at=None,
            completion_tokens=None,
        )
        for plugin in self.pipeline.observers:  # the plugins' bookings there go
            plugin.on_finished(routed, unserved)
        request, result, state = routed.request, routed.result, routed.state
        others = tuple(t for t in result.targets if t.name != actual.endpoint.name)
        result = SchedulingResult((actual.endpoint, *others), result.profile, result.scores)
        for hook in self.pipeline.pre_request:
            hook.pre_request(request, result, state)
        if previous.in_flight > 0:
            previous.in_flight -= 1
        actual.in_flight += 1
        routed.result, routed.booked = result, actual
        for observer in self._on_rebooked:
            observer.on_rebooked(routed, previous, now)

    def first_token(self, routed: RoutedRequest, now: float) -> None:
        if routed.first_token_at is not None or routed.outcome is not None:
            return
        routed.first_token_at = now
        for observer in self._on_first_token:
            observer.on_first_token(routed, now)

    def progress(self, routed: RoutedRequest, tokens: int, now: float) -> None:
        if routed.outcome is not None:
            return
        for observer in self._on_progress:
            observer.on_progress(routed, tokens, now)

    def finished(
        self,
        routed: RoutedRequest,
        now: float,
        *,
        status: int | None,
        completed: bool,
        streaming: bool,
        completion_tokens: int | None,
    ) -> RequestOutcome:
        """The request is over at ``now``: release its booking and tell every observer how it
        ended. Idempotent: a second call returns the first outcome and does nothing."""
        if routed.outcome is not None:
            return routed.outcome
        booked = routed.booked
        if booked.in_flight > 0:
            booked.in_flight -= 1
        outcome = RequestOutcome(
            endpoint=routed.result.endpoint,
            received_at=routed.received_at,
            finished_at=now,
            status=status,
            streaming=streaming,
            completed=completed,
            first_token_at=routed.first_token_at,
            completion_tokens=completion_tokens,
        )
        routed.outcome = outcome
        for observer in self._on_finished:
            observer.on_finished(routed, outcome)
        return outcome

    def upstream_headers(self, routed: RoutedRequest) -> dict[str, str]:
        """Headers every observer adds to the request forwarded to the endpoint."""
        headers: dict[str, str] = {}
        for observer in self._upstream_headers:
            headers.update(observer.upstream_headers(routed))
        return headers

    def debug_headers(self, routed: RoutedRequest) -> dict[str, str]:
        """The routing decision as response headers: the endpoint, then each observer's."""
        headers = {ENDPOINT_HEADER: routed.endpoint_name}
        for observer in self._debug_headers:
            headers.update(observer.debug_headers(routed))
        return headers
