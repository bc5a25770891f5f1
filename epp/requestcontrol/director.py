"""Request control: the ext_proc side of one request's path, from parse to last response byte.

The driver (the ext_proc stream, the ext_authz check) opens one :class:`RequestHandle` per
request (:meth:`Director.open`) and calls its steps, in order: :meth:`RequestHandle.schedule`
(or :meth:`RequestHandle.schedule_bodyless`), whose events (``epp.requestcontrol.events``) it
iterates, :meth:`RequestHandle.response_headers`, :meth:`RequestHandle.response_body` for each
chunk until it says the EPP needs no more, and always :meth:`RequestHandle.finish` once, however
the stream ended. The handle parses the request, reads the response's progress and status, and
hands each step to the request lifecycle (``epp.requestcontrol.lifecycle``), which owns the
bookings and the observers; the director keeps the request metrics through a lifecycle
observer, and what its requests teach it (bytes per token, decode rates).

With first-token metering (``epp.requestcontrol.completion_log``) most streamed responses are
read to their first token only; :meth:`RequestHandle.finish` then keeps them booked until the
gateway's access log finishes them (:meth:`Director.log_entry`), or until they have been silent
too long (:meth:`Director.expire_handoffs`, called periodically).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping

from epp.datalayer.endpoints import EndpointStore
from epp.errors import NoEndpointAvailable, RequestError
from epp.flowcontrol.gate import Admission, FlowGate, FlowTicket
from epp.metrics import ModelSeries, RequestMetrics
from epp.requestcontrol.completion_log import (
    BytesPerToken,
    DecodeRates,
    EndpointMeans,
    HandOffs,
    LogEntry,
    MeteringPlan,
    MeteringSettings,
    finish_time,
)
from epp.requestcontrol.events import Held, RequestEvent, Routed
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.requestcontrol.openai_request import parse_openai_request
from epp.requestcontrol.request_headers import DEBUG_HEADER
from epp.requestcontrol.response_meter import ResponseMeter
from epp.scheduling.framework import RequestOutcome, slo_misses
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.pipeline import NoCandidates
from epp.scheduling.types import ApiKind, LLMRequest, SchedulingResult
from epp.tokenizer.cache import TooLongToInline
from epp.tokenizer.model import GIL_FREE_CHARS, PromptTokenizer

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
# A client-supplied request id is kept only if it is short and plain; it ends up in logs,
# upstream headers and engine request ids.
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Bodies larger than this are parsed on the event loop only while what is left to tokenize (past
# the tokenizer cache's reuse) is at most GIL_FREE_CHARS: a longer tokenization is made in a
# worker thread instead, where it does not stall the loop. Extending a seen prompt thus costs no
# thread hop (~0.2 ms of CPU); a prompt seen first costs its parse twice up to the tokenization.
OFFLOAD_BODY_BYTES = 64 << 10


class RequestHandle:
    """One request's way through the director, from its headers to its finish: its driver (the
    ext_proc stream, the ext_authz check) calls its steps in the order of the module doc and
    holds nothing else of it. Times are the director's clock's."""

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
                streaming and routed is not None and not d.plan.meter_fully(_answer_kind(routed.request))
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
            d.lifecycle.first_token(routed, now)
            d.lifecycle.progress(routed, meter.tokens, now)
            if self.flow_ticket is not None:
                self.flow_ticket.first_token()
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
                d.bytes_per_token.observe(_answer_kind(routed.request), meter.body_bytes, tokens)
        completed = self.response_complete and self.status is not None and self.status < 400
        error = str(self.status) if self.response_complete else "aborted"
        streaming = meter is not None and meter.streaming
        self.settle(routed, now, completed, streaming, tokens, error)

    def first_token(self, routed: RoutedRequest, at: float) -> None:
        """The first token, as the access log says or the director estimates it."""
        self._director.lifecycle.first_token(routed, at)
        if self.flow_ticket is not None:
            self.flow_ticket.first_token()

    def settle(
        self,
        routed: RoutedRequest,
        now: float,
        completed: bool,
        streaming: bool,
        completion_tokens: int | None,
        error: str,
    ) -> None:
        """The routed request is over at ``now``: the lifecycle, flow control and the metrics
        hear how it ended (``error``: the error count's label if it did not complete)."""
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


class Director:
    """The request lifecycle's ext_proc driver: opens each request's handle, and keeps what the
    handles share (the endpoint store, the lifecycle, the metrics, the requests handed off to
    the access log, and what finished requests taught it)."""

    def __init__(
        self,
        lifecycle: RequestLifecycle,
        store: EndpointStore,
        tokenizer: PromptTokenizer,
        metrics: RequestMetrics,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        objective_priorities: Mapping[str, int] | None = None,
        default_max_model_len: int | None = None,
        flow_gate: FlowGate | None = None,
        metering: MeteringSettings | None = None,
    ) -> None:
        """``default_max_model_len`` is the context length while no engine has reported its own;
        ``flow_gate`` holds requests while the pool is saturated (flow control, off without it);
        ``metering`` says how streamed responses are metered (every chunk, by default);
        ``tokenizer`` may be replaced by assigning ``self.tokenizer`` (the next request uses it)."""
        self.flow_gate = flow_gate
        self.metering = metering or MeteringSettings()
        self.plan = MeteringPlan(self.metering)
        self.bytes_per_token = BytesPerToken()
        self.decode_rates = DecodeRates()
        self.first_token_delays = EndpointMeans()
        """Each endpoint's recent time to first token, from the access log (ext_authz's requests)."""
        self.handoffs: HandOffs[RequestHandle] = HandOffs(self.metering.silence_s)
        self.live_ids: set[str] = set()
        """The request ids of handles not finished yet (handed-off ones included)."""
        metrics.handed_off.set_function(lambda: len(self.handoffs))
        self.lifecycle = lifecycle
        self.default_max_model_len = default_max_model_len
        self.objective_priorities = objective_priorities if objective_priorities is not None else {}
        self.store = store
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.clock = clock
        self.rng = rng or random.Random()
        lifecycle.add_observer(_MetricsObserver(metrics))

    def open(self, headers: Mapping[str, str]) -> RequestHandle:
        """A request's handle, under the client's request id if it is plain and no live request
        has it (the access log finds a handed-off request by its id), else under a new one."""
        request_id = headers.get(REQUEST_ID_HEADER, "")
        if not _SAFE_REQUEST_ID.fullmatch(request_id) or request_id in self.live_ids:
            request_id = uuid.uuid4().hex
        self.live_ids.add(request_id)
        return RequestHandle(self, request_id, self.clock())

    def skips_response_headers(self, headers: Mapping[str, str]) -> bool:
        """Whether a request with these (gated) headers needs no response headers: with
        first-token metering the response's status and the endpoint that answered come with its
        first body chunk (Envoy's response attributes) and the access log finishes it, so only a
        decision trace, which goes in the response headers, needs them. One message fewer each
        way per streamed request."""
        return self.metering.mode == "first-token" and DEBUG_HEADER not in headers

    def rebook_if_served_elsewhere(self, routed: RoutedRequest, served_by: str) -> None:
        """Envoy retried the request on a fallback: the booking moves there."""
        if served_by == routed.result.endpoint.hostport:
            return
        actual = next((s for s in self.store.all() if s.endpoint.hostport == served_by), None)
        if actual is not None:
            self.lifecycle.rebooked(routed, actual, self.clock())

    def log_entry(self, entry: LogEntry) -> None:
        """The gateway logged a request: finish it if it was handed off to the log (an entry for
        a stream still open, ``intermediate``, only moves its decode progress on)."""
        now = self.clock()
        if entry.intermediate:
            handle = self.handoffs.heard(entry.request_id, now)
            self.metrics.access_log_entries.labels("intermediate" if handle else "unknown").inc()
            routed = handle.routed if handle is not None else None
            if handle is not None and routed is not None and routed.request.stream:
                # A stream going on is a sign of life, as its tokens were when the EPP read them.
                self.store.record_alive(routed.endpoint_name, now)
                self._logged_first_token(handle, routed, entry, now)
                tokens = self._logged_tokens(routed, entry)
                if tokens is not None:
                    self.lifecycle.progress(routed, tokens, now)
            return
        handle = self.handoffs.pop(entry.request_id)
        if handle is None and entry.request_id in self.live_ids:
            self.handoffs.keep_early(entry)
            return
        self.metrics.access_log_entries.labels("final" if handle else "unknown").inc()
        if handle is None or handle.routed is None:
            return
        routed = handle.routed
        if entry.served_by:
            self.rebook_if_served_elsewhere(routed, entry.served_by)
        if routed.request.stream:
            self._logged_first_token(handle, routed, entry, now)
        finished_at = finish_time(handle.received_at, routed.first_token_at, entry, now)
        if handle.status is None and entry.status >= 500:  # a response the EPP never saw
            self.upstream_failed(routed.endpoint_name, f"HTTP {entry.status}")
        elif entry.last_upstream_byte_s is not None:
            self.store.record_alive(routed.endpoint_name, finished_at)
        self.metrics.access_log_lag.observe(now - finished_at)
        handle.status = entry.status or handle.status
        error = str(entry.status) if entry.ended == "complete" else entry.ended
        streaming = routed.request.stream
        tokens = self._logged_tokens(routed, entry)
        handle.settle(routed, finished_at, entry.completed, streaming, tokens, error)

    def _logged_first_token(
        self, handle: RequestHandle, routed: RoutedRequest, entry: LogEntry, now: float
    ) -> None:
        """A stream the EPP never read (``hand_off_routed``) starts decoding when its log says;
        the logged time replaces an estimate (the outcome reports it; the bookings moved then)."""
        if entry.first_body_byte_s is None or (
            routed.first_token_at is not None and not handle.first_token_estimated
        ):
            return
        at = min(handle.received_at + entry.first_body_byte_s, now)
        self.first_token_delays.observe(routed.endpoint_name, at - handle.received_at)
        if handle.first_token_estimated:
            routed.first_token_at = at
            handle.first_token_estimated = False
            return
        handle.first_token(routed, at)

    def _logged_tokens(self, routed: RoutedRequest, entry: LogEntry) -> int | None:
        """A logged stream's output tokens so far, from its body bytes; None for a non-streamed
        answer (the bytes-per-token lines are learned from streams)."""
        if not routed.request.stream:
            return None
        tokens = self.bytes_per_token.tokens(_answer_kind(routed.request), entry.response_bytes)
        if tokens is None and entry.sse_events:  # no stream of this kind was read (ext_authz)
            tokens = max(1, entry.sse_events - _tokenless_events(routed.request))
        return tokens

    def estimate_progress(self) -> None:
        """Move each handed-off request's decode progress on by its endpoint's recent TPOT; a
        stream whose first token no one saw yet (ext_authz's) starts decoding once its endpoint's
        recent time to first token has passed."""
        now = self.clock()
        for handle in self.handoffs.waiting():
            routed = handle.routed
            assert routed is not None
            if routed.first_token_at is None and routed.request.stream:
                delay = self.first_token_delays.mean(routed.endpoint_name) or 0.0
                if now - handle.received_at < delay:
                    continue
                handle.first_token(routed, handle.received_at + delay)
                handle.first_token_estimated = True
            if routed.first_token_at is None:  # a non-streamed answer: its decode is not seen
                continue
            decoding_s = now - routed.first_token_at
            tokens = self.decode_rates.tokens(routed.endpoint_name, decoding_s, routed.request.max_tokens)
            if tokens is not None:
                self.lifecycle.progress(routed, tokens, now)

    def expire_handoffs(self) -> int:
        """Finish, as not completed, the handed-off requests silent too long; how many there were."""
        now = self.clock()
        expired = list(self.handoffs.expired(now))
        for handle in expired:
            assert handle.routed is not None
            handle.settle(handle.routed, now, False, handle.routed.request.stream, None, "unlogged")
        self.metrics.handed_off_expired.inc(len(expired))
        return len(expired)

    def upstream_failed(self, name: str, why: str) -> None:
        self.metrics.upstream_failures.labels(name).inc()
        self.store.record_failure(name, why)


def _answer_kind(request: LLMRequest) -> str:
    """What a streamed answer's bytes per token depend on: the model (its name is in every
    event) and the API (chat deltas or completion texts)."""
    return f"{request.model} {request.api.value}"


def _tokenless_events(request: LLMRequest) -> int:
    """A stream's JSON events that carry no output token: a chat stream's first (the role), and
    the usage one when the client asked for it; every other event carries one (vLLM's)."""
    options = request.body.get("stream_options")
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return int(request.api is ApiKind.CHAT) + int(usage)


class _MetricsObserver(LifecycleObserver):
    """The director's request metrics, kept from the lifecycle's events."""

    def __init__(self, metrics: RequestMetrics) -> None:
        self.metrics = metrics

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        self.metrics.for_model(routed.request.model).running.inc()

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        request = routed.request
        series = self.metrics.for_model(request.model)
        series.running.dec()
        if not outcome.completed:
            return
        series.duration.observe(outcome.e2e_s)
        series.input_tokens.observe(request.input_tokens)
        if outcome.completion_tokens is not None:
            series.output_tokens.observe(outcome.completion_tokens)
        if outcome.streaming and (ttft := outcome.ttft_s) is not None:
            series.ttft.observe(ttft)
            if (tpot := outcome.tpot_s) is not None:
                series.tpot.observe(tpot)
        ttft_missed, tpot_missed = slo_misses(request, outcome)
        if ttft_missed:
            series.ttft_slo_violations.inc()
        if tpot_missed:
            series.tpot_slo_violations.inc()
