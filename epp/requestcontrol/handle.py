"""One request's handle (:class:`RequestHandle`): what its driver (the ext_proc stream, the
ext_authz check) calls at each step of the request, from its parse and routing to its finish.
The :class:`~epp.requestcontrol.director.Director` opens it, and keeps what the handles share.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from epp.errors import NoEndpointAvailable, RequestError
from epp.flowcontrol.gate import Admission, FlowTicket
from epp.metrics import ModelSeries
from epp.requestcontrol.events import Held, RequestEvent, Routed
from epp.requestcontrol.openai_request import parse_openai_request
from epp.requestcontrol.response_meter import ResponseMeter
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.pipeline import NoCandidates
from epp.scheduling.types import LLMRequest, SchedulingResult
from epp.tokenizer.cache import TooLongToInline
from epp.tokenizer.model import GIL_FREE_CHARS

if TYPE_CHECKING:
    from epp.requestcontrol.director import Director

log = logging.getLogger(__name__)

# Bodies larger than this are parsed on the event loop only while what is left to tokenize (past
# the tokenizer cache's reuse) is at most GIL_FREE_CHARS: a longer tokenization is made in a
# worker thread instead, where it does not stall the loop. Extending a seen prompt thus costs no
# thread hop (~0.2 ms of CPU); a prompt seen first costs its parse twice up to the tokenization.
OFFLOAD_BODY_BYTES = 64 << 10


class RequestHandle:
    """One request's way through request control, from its headers to its finish: its driver
    (the ext_proc stream, the ext_authz check) calls its steps in the order that
    ``epp.requestcontrol.director`` gives, and holds nothing else of it. Times are the
    director's clock's."""

    __slots__ = (
        "_director",
        "admission",
        "bodyless_endpoint",
        "finished",
        "first_token_estimated",
        "flow_ticket",
        "hand_off",
        "meter",
        "received_at",
        "request",
        "request_id",
        "response_complete",
        "routed",
        "series",
        "status",
    )

    def __init__(self, director: Director, request_id: str, received_at: float) -> None:
        self._director = director
        self.request_id = request_id
        self.received_at = received_at
        self.request: LLMRequest | None = None
        self.routed: RoutedRequest | None = None
        """Set once the lifecycle routed the request (requests with a body)."""
        self.bodyless_endpoint: str | None = None
        """Where a request without a body (e.g. ``GET /v1/models``) went; it is not booked."""
        self.status: int | None = None
        self.meter: ResponseMeter | None = None
        self.response_complete = False
        self.finished = False
        self.series: ModelSeries | None = None
        self.admission: Admission | None = None
        """Flow control's word on it, from its queueing (with flow control on)."""
        self.flow_ticket: FlowTicket | None = None
        """Held from flow control's dispatch to the finish (with flow control on)."""
        self.hand_off = False
        """The access log finishes it: a streamed response metered to its first token only, or
        a non-streamed one not read at all (first-token metering)."""
        self.first_token_estimated = False
        """Its first token is an estimate (:meth:`Director.estimate_progress`) the log will
        correct."""

    @property
    def endpoint_name(self) -> str | None:
        return self.routed.endpoint_name if self.routed is not None else self.bodyless_endpoint

    async def schedule(
        self, path: str, headers: Mapping[str, str], body: bytes
    ) -> AsyncIterator[RequestEvent]:
        """Parse and route a request with a body: :class:`Held` while flow control holds it,
        then :class:`Routed`. Raises a :class:`RequestError` to refuse it."""
        d = self._director
        learned = d.store.max_model_len()
        max_model_len = learned if learned is not None else d.default_max_model_len
        tokenizer = d.tokenizer  # read once: the ``auto`` source may replace it meanwhile
        if not tokenizer.exact:  # an estimated count must not refuse a prompt the engine takes
            max_model_len = None
        args = (path, headers, body, tokenizer, self.request_id, d.objective_priorities, max_model_len)
        if len(body) > OFFLOAD_BODY_BYTES:
            try:
                request = parse_openai_request(*args, max_chars=GIL_FREE_CHARS)
            except TooLongToInline:
                request = await asyncio.to_thread(parse_openai_request, *args)
        else:
            request = parse_openai_request(*args)
        self.request = request
        self.series = d.metrics.for_model(request.model)
        self.series.requests.inc()
        if d.flow_gate is not None:  # waits while the pool is saturated
            self.admission = admission = d.flow_gate.admit(request, self.received_at)
            if admission.held_s is not None:
                yield Held(admission.held_s)  # a driver that stops here withdraws it in finish()
            self.flow_ticket = await admission.ticket()
        candidates = d.store.candidates()
        if not candidates:
            raise NoEndpointAvailable("no model server endpoint is ready")
        if self.flow_ticket is not None:  # dispatched to fit some endpoints only
            candidates = self.flow_ticket.restrict(candidates)
        started = d.clock()
        try:
            self.routed = routed = await d.lifecycle.route(request, candidates, self.received_at, started)
        except NoCandidates as exc:
            raise NoEndpointAvailable(f"no endpoint can serve this request: {exc}") from None
        d.metrics.scheduling.observe(d.clock() - started)
        if self.flow_ticket is not None:
            self.flow_ticket.routed(routed.endpoint_name, routed.state, d.clock())
        yield Routed(routed.result)

    def schedule_bodyless(self) -> SchedulingResult:
        """Route a request without a body (e.g. ``GET /v1/models``) to any ready endpoint."""
        d = self._director
        candidates = d.store.candidates()
        if not candidates:
            raise NoEndpointAvailable("no model server endpoint is ready")
        chosen = d.rng.choice(candidates).endpoint
        self.bodyless_endpoint = chosen.name
        return SchedulingResult(targets=(chosen,), profile="bodyless")

    def reject(self, error: RequestError) -> None:
        """The EPP answered the request itself with ``error``: one log line, one error count."""
        level = (
            logging.INFO if error.status < 500 else logging.WARNING if error.status > 500 else logging.ERROR
        )
        log.log(level, "request %s answered %d: %s", self.request_id, error.status, error.log_message())
        self._director.metrics.error(self.series, str(error.status))

    def upstream_headers(self) -> dict[str, str]:
        """Headers for the request forwarded to the endpoint (the lifecycle observers')."""
        return self._director.lifecycle.upstream_headers(self.routed) if self.routed is not None else {}

    def debug_headers(self) -> dict[str, str]:
        """The routing decision, for requests that asked for it with ``x-llm-epp-debug``."""
        routed = self.routed
        if routed is None or not routed.request.debug:
            return {}
        return self._director.lifecycle.debug_headers(routed)

    def hand_off_unread(self) -> bool:
        """Whether the routed request's response needs no ext_proc message at all, and if so
        hands it off to the access log. With first-token metering a non-streamed answer has no
        first token to read: its entry's status and last upstream byte finish it. Not when its
        caller gets the decision trace, which goes in the response headers."""
        routed = self.routed
        if self._director.metering.mode != "first-token" or routed is None:
            return False
        if routed.request.stream or routed.request.debug:
            return False
        self.hand_off = True
        return True

    def hand_off_routed(self) -> None:
        """Hand the routed request off to the access log at once, whatever its response: the
        caller (the ext_authz check) sees nothing of it past its routing. A stream's first token
        then comes from its log entries (``LogEntry.first_body_byte_s``)."""
        assert self.routed is not None
        self.hand_off = True
        self.finished = True
        d = self._director
        d.handoffs.add(self.request_id, self, d.clock())

    def response_headers(
        self, status: int, content_type: str, body_follows: bool, served_by: str | None = None
    ) -> None:
        """The response started. Without a body to watch, the request is complete now.

        ``served_by``: the ``ip:port`` that answered, as Envoy reports it (``SERVED_BY_HEADER``);
        when Envoy retried the request on a fallback, the booking moves there."""
        d = self._director
        self.status = status
        routed = self.routed
        if served_by and routed is not None:
            d.rebook_if_served_elsewhere(routed, served_by)
        if body_follows:
            streaming = content_type.startswith("text/event-stream")
            self.meter = ResponseMeter(streaming=streaming)
            self.hand_off = (
                streaming and routed is not None and not d.plan.meter_fully(answer_kind(routed.request))
            )
        else:
            self.response_complete = True
        name = self.endpoint_name
        if name is None:
            return
        if status >= 500:
            d.upstream_failed(name, f"HTTP {status}")
        else:
            d.store.record_alive(name, d.clock())

    def response_body(self, chunk: bytes, end_of_stream: bool) -> bool:
        """One chunk of the watched response body; returns whether the EPP needs no more of it.
        The response is complete at the body's end or at a streamed response's ``data: [DONE]``,
        whichever comes first; a response to hand off needs nothing past its first token."""
        meter = self.meter
        if meter is None:
            return True
        routed = self.routed
        if meter.feed(chunk) and routed is not None:
            d = self._director
            now = d.clock()
            d.store.record_alive(routed.endpoint_name, now)
            self.first_token(now)
            d.lifecycle.progress(routed, meter.tokens, now)
        # ``data: [DONE]`` completes a streamed response as surely as the body's end does: the
        # openai SDK closes its connection on reading it, and when that beats the engine's end
        # of body to Envoy, Envoy closes this stream without sending an end_of_stream.
        if end_of_stream or meter.done:
            self.response_complete = True
            return True
        return self.hand_off and routed is not None and routed.first_token_at is not None

    def finish(self) -> None:
        """The stream is over, completed or not; a response handed off at its first token waits
        for its access-log entry. Idempotent."""
        if self.finished:
            return
        self.finished = True
        d = self._director
        routed = self.routed
        now = d.clock()
        # A stream waits for its entry once its first token came; a non-streamed answer from
        # its routing on (``hand_off_unread``).
        started = routed is not None and (routed.first_token_at is not None or not routed.request.stream)
        if self.hand_off and not self.response_complete and started:
            early = d.handoffs.add(self.request_id, self, now)
            if early is not None:
                d.log_entry(early)
            return
        if d.handoffs.drop_early(self.request_id) is not None:
            d.metrics.access_log_entries.labels("unknown").inc()  # the stream said it all
        if routed is None:  # refused, or body-less: routed, not metered
            d.live_ids.discard(self.request_id)
            self._release_flow()
            return
        meter = self.meter
        tokens = None
        if meter is not None:
            meter.finish()
            tokens = meter.completion_tokens
            if meter.streaming and self.response_complete:
                d.bytes_per_token.observe(answer_kind(routed.request), meter.body_bytes, tokens)
        completed = self.response_complete and self.status is not None and self.status < 400
        error = str(self.status) if self.response_complete else "aborted"
        streaming = meter is not None and meter.streaming
        self.settle(now, completed, streaming, tokens, error)

    def first_token(self, at: float) -> None:
        """The routed request's first token: as its response showed it, as the access log says,
        or as the director estimates it."""
        assert self.routed is not None
        self._director.lifecycle.first_token(self.routed, at)
        if self.flow_ticket is not None:
            self.flow_ticket.first_token()

    def settle(
        self,
        now: float,
        completed: bool,
        streaming: bool,
        completion_tokens: int | None,
        error: str,
    ) -> None:
        """The routed request is over at ``now``: the lifecycle, flow control and the metrics
        hear how it ended (``error``: the error count's label if it did not complete)."""
        routed = self.routed
        assert routed is not None
        d = self._director
        d.live_ids.discard(self.request_id)
        self._release_flow()
        outcome = d.lifecycle.finished(
            routed,
            now,
            status=self.status,
            completed=completed,
            streaming=streaming,
            completion_tokens=completion_tokens,
        )
        if outcome.completed and streaming and (tpot := outcome.tpot_s) is not None:
            d.decode_rates.observe(routed.endpoint_name, tpot)
        if not outcome.completed and self.series is not None:
            d.metrics.error(self.series, error)

    def _release_flow(self) -> None:
        """Flow control's hold on the request ends with the request: its booking goes, or, still
        queued (its stream went away while it waited), it leaves the queue."""
        if self.flow_ticket is not None:
            self.flow_ticket.finished()
        elif self.admission is not None:
            self.admission.withdraw()


def answer_kind(request: LLMRequest) -> str:
    """What a streamed answer's bytes per token depend on: the model (its name is in every
    event) and the API (chat deltas or completion texts)."""
    return f"{request.model} {request.api.value}"
