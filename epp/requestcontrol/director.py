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

import random
import re
import uuid
from collections.abc import Callable, Mapping

from epp.datalayer.endpoints import EndpointStore
from epp.flowcontrol.gate import FlowGate
from epp.metrics import RequestMetrics
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
from epp.requestcontrol.handle import RequestHandle, answer_kind
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.requestcontrol.request_headers import DEBUG_HEADER
from epp.scheduling.framework import RequestOutcome, slo_misses
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.types import ApiKind, LLMRequest
from epp.tokenizer.model import PromptTokenizer

REQUEST_ID_HEADER = "x-request-id"
# A client-supplied request id is kept only if it is short and plain; it ends up in logs,
# upstream headers and engine request ids.
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


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
        handle.settle(finished_at, entry.completed, streaming, tokens, error)

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
        handle.first_token(at)

    def _logged_tokens(self, routed: RoutedRequest, entry: LogEntry) -> int | None:
        """A logged stream's output tokens so far, from its body bytes; None for a non-streamed
        answer (the bytes-per-token lines are learned from streams)."""
        if not routed.request.stream:
            return None
        tokens = self.bytes_per_token.tokens(answer_kind(routed.request), entry.response_bytes)
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
                handle.first_token(handle.received_at + delay)
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
            handle.settle(now, False, handle.routed.request.stream, None, "unlogged")
        self.metrics.handed_off_expired.inc(len(expired))
        return len(expired)

    def upstream_failed(self, name: str, why: str) -> None:
        self.metrics.upstream_failures.labels(name).inc()
        self.store.record_failure(name, why)


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
