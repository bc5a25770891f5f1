"""Request control: one request's path through the EPP, from parse to last response byte.

The ext_proc adapter calls, in order: :meth:`Director.schedule` (or
:meth:`Director.schedule_bodyless`), :meth:`Director.response_headers`,
:meth:`Director.response_body` for each chunk, and always :meth:`Director.finish` once,
however the stream ended. The director owns the bookkeeping around the pure scheduling
core: candidates, in-flight counts, latency measurements and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from epp.datalayer.endpoints import EndpointStore
from epp.errors import NoEndpointAvailable, RequestError
from epp.flowcontrol.gate import FlowGate, FlowTicket
from epp.latency.predictions import LATENCY_PREDICTIONS, PREDICTION_FALLBACK
from epp.metrics import EppMetrics, ModelSeries
from epp.requestcontrol.openai_request import parse_openai_request
from epp.requestcontrol.response_meter import ResponseMeter
from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.pipeline import NoCandidates, Pipeline
from epp.scheduling.types import LLMRequest, SchedulingResult
from epp.tokenization import ModelTokenizer

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
# A client-supplied request id is kept only if it is short and plain; it ends up in logs,
# upstream headers and engine request ids.
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Bodies larger than this are parsed and tokenized in a worker thread (see GIL_FREE_CHARS).
OFFLOAD_BODY_BYTES = 64 << 10


@dataclass(slots=True)
class RequestRecord:
    """What the EPP knows about one request; times are from the director's clock."""

    request_id: str
    received_at: float
    request: LLMRequest | None = None
    result: SchedulingResult | None = None
    status: int | None = None
    meter: ResponseMeter | None = None
    first_token_at: float | None = None
    response_complete: bool = False
    finished_at: float | None = None
    series: ModelSeries | None = None
    state: CycleState | None = None
    flow_ticket: FlowTicket | None = None

    @property
    def endpoint_name(self) -> str | None:
        return self.result.endpoint.name if self.result else None


class Director:
    def __init__(
        self,
        pipeline: Pipeline,
        store: EndpointStore,
        tokenizer: ModelTokenizer,
        metrics: EppMetrics,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        objective_priorities: Mapping[str, int] | None = None,
        default_max_model_len: int | None = None,
        flow_gate: FlowGate | None = None,
    ) -> None:
        """``default_max_model_len`` is the context length while no engine has reported its own;
        ``flow_gate`` holds requests while the pool is saturated (flow control, off without it)."""
        self.flow_gate = flow_gate
        self.pipeline = pipeline
        self.default_max_model_len = default_max_model_len
        self.objective_priorities = objective_priorities if objective_priorities is not None else {}
        self.store = store
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.clock = clock
        self.rng = rng or random.Random()

    def new_record(self, headers: Mapping[str, str]) -> RequestRecord:
        request_id = headers.get(REQUEST_ID_HEADER, "")
        if not _SAFE_REQUEST_ID.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        return RequestRecord(request_id=request_id, received_at=self.clock())

    async def schedule(
        self, record: RequestRecord, path: str, headers: Mapping[str, str], body: bytes
    ) -> SchedulingResult:
        """Parse and route a request with a body. Raises a :class:`RequestError` to refuse it."""
        learned = self.store.max_model_len()
        max_model_len = learned if learned is not None else self.default_max_model_len
        args = (
            path,
            headers,
            body,
            self.tokenizer,
            record.request_id,
            self.objective_priorities,
            max_model_len,
        )
        if len(body) > OFFLOAD_BODY_BYTES:
            request = await asyncio.to_thread(parse_openai_request, *args)
        else:
            request = parse_openai_request(*args)
        record.request = request
        record.series = self.metrics.for_model(request.model)
        record.series.requests.inc()
        if self.flow_gate is not None:  # waits while the pool is saturated
            record.flow_ticket = await self.flow_gate.wait(request, record.received_at)
        candidates = self.store.candidates()
        if not candidates:
            raise NoEndpointAvailable("no model server endpoint is ready")
        started = self.clock()
        record.state = CycleState()
        try:
            result = await self.pipeline.schedule(request, candidates, record.state)
        except NoCandidates as exc:
            raise NoEndpointAvailable(f"no endpoint can serve this request: {exc}") from None
        self.metrics.scheduling.observe(self.clock() - started)
        if record.flow_ticket is not None:
            record.flow_ticket.routed(result.endpoint.name, record.state, self.clock())
        if (fallback := record.state.get(PREDICTION_FALLBACK)) is not None:
            self.metrics.prediction_fallbacks.labels(fallback).inc()
        return self._routed(record, result)

    def schedule_bodyless(self, record: RequestRecord) -> SchedulingResult:
        """Route a request without a body (e.g. ``GET /v1/models``) to any ready endpoint."""
        candidates = self.store.candidates()
        if not candidates:
            raise NoEndpointAvailable("no model server endpoint is ready")
        chosen = self.rng.choice(candidates)
        return self._routed(record, SchedulingResult(targets=(chosen.endpoint,), profile="bodyless"))

    def _routed(self, record: RequestRecord, result: SchedulingResult) -> SchedulingResult:
        record.result = result
        self.store.request_started(result.endpoint.name)
        if record.series is not None:
            record.series.running.inc()
        return result

    def reject(self, record: RequestRecord, error: RequestError) -> None:
        """The EPP answered the request itself with ``error``: one log line, one error count."""
        level = (
            logging.INFO if error.status < 500 else logging.WARNING if error.status > 500 else logging.ERROR
        )
        log.log(level, "request %s answered %d: %s", record.request_id, error.status, error.log_message())
        self.metrics.error(record.series, str(error.status))

    def debug_headers(self, record: RequestRecord) -> dict[str, str]:
        """The routing decision, for requests that asked for it with ``x-llm-epp-debug``."""
        request, result, state = record.request, record.result, record.state
        if request is None or not request.debug or result is None or state is None:
            return {}
        headers = {"x-llm-epp-endpoint": result.endpoint.name}
        predictions = state.get(LATENCY_PREDICTIONS)
        predicted = predictions.by_endpoint.get(result.endpoint.name) if predictions else None
        if predicted is not None:
            headers["x-llm-epp-predicted-ttft-ms"] = f"{predicted.ttft_ms:.3f}"
            headers["x-llm-epp-predicted-tpot-ms"] = f"{predicted.tpot_ms:.3f}"
        if predictions is not None:
            headers["x-llm-epp-candidates-ttft-ms"] = ",".join(
                f"{name}={p.ttft_ms:.1f}" for name, p in predictions.by_endpoint.items()
            )
        if (fallback := state.get(PREDICTION_FALLBACK)) is not None:
            headers["x-llm-epp-prediction-fallback"] = fallback
        return headers

    def response_headers(
        self, record: RequestRecord, status: int, content_type: str, body_follows: bool
    ) -> None:
        """The response started. Without a body to watch, the request is complete now."""
        record.status = status
        if body_follows:
            record.meter = ResponseMeter(streaming=content_type.startswith("text/event-stream"))
        else:
            record.response_complete = True
        if status >= 500 and record.endpoint_name:
            self._upstream_failed(record, f"HTTP {status}")

    def response_body(self, record: RequestRecord, chunk: bytes, end_of_stream: bool) -> None:
        meter = record.meter
        if meter is None:
            return
        if meter.feed(chunk):
            now = self.clock()
            first = record.first_token_at is None
            if first:
                record.first_token_at = now
            if record.request is not None and record.result is not None and record.state is not None:
                for observer in self.pipeline.observers:
                    if first:
                        observer.on_first_token(record.request, record.result, record.state, now)
                    observer.on_progress(record.request, record.result, record.state, meter.tokens, now)
        if end_of_stream:
            record.response_complete = True

    def finish(self, record: RequestRecord) -> None:
        """The stream is over, completed or not. Idempotent."""
        if record.finished_at is not None:
            return
        record.finished_at = self.clock()
        if record.flow_ticket is not None:
            record.flow_ticket.finished()
        if record.result is None:
            return
        self.store.request_finished(record.result.endpoint.name)
        series, request, state = record.series, record.request, record.state
        if series is None or request is None or state is None:  # body-less: routed, not metered
            return
        series.running.dec()
        meter = record.meter
        if meter is not None:
            meter.finish()
        completed = record.response_complete and record.status is not None and record.status < 400
        outcome = RequestOutcome(
            endpoint=record.result.endpoint,
            received_at=record.received_at,
            finished_at=record.finished_at,
            status=record.status,
            streaming=meter is not None and meter.streaming,
            completed=completed,
            first_token_at=record.first_token_at,
            completion_tokens=meter.completion_tokens if meter is not None else None,
        )
        for observer in self.pipeline.observers:
            observer.on_finished(request, record.result, state, outcome)
        if not completed:
            self.metrics.error(series, str(record.status) if record.response_complete else "aborted")
            return
        self._observe_latency(request, outcome, series)
        self._observe_slo(request, state, outcome, series)

    def _observe_latency(self, request: LLMRequest, outcome: RequestOutcome, series: ModelSeries) -> None:
        series.duration.observe(outcome.e2e_s)
        series.input_tokens.observe(request.input_tokens)
        if outcome.completion_tokens is not None:
            series.output_tokens.observe(outcome.completion_tokens)
        if outcome.streaming and (ttft := outcome.ttft_s) is not None:
            series.ttft.observe(ttft)
            if (tpot := outcome.tpot_s) is not None:
                series.tpot.observe(tpot)

    def _observe_slo(
        self, request: LLMRequest, state: CycleState, outcome: RequestOutcome, series: ModelSeries
    ) -> None:
        predictions = state.get(LATENCY_PREDICTIONS)
        predicted = predictions.by_endpoint.get(outcome.endpoint.name) if predictions else None
        if predicted is not None:
            series.predicted_ttft.observe(predicted.ttft_ms / 1e3)
            series.predicted_tpot.observe(predicted.tpot_ms / 1e3)
        # A non-streaming client sees its first token when the whole response arrives.
        first_token_s = outcome.ttft_s if outcome.streaming else outcome.e2e_s
        if (
            request.slo_ttft_ms is not None
            and first_token_s is not None
            and first_token_s * 1e3 > request.slo_ttft_ms
        ):
            series.ttft_slo_violations.inc()
        tpot = outcome.tpot_s
        if (
            request.slo_tpot_ms is not None
            and outcome.streaming
            and tpot is not None
            and tpot * 1e3 > request.slo_tpot_ms
        ):
            series.tpot_slo_violations.inc()

    def _upstream_failed(self, record: RequestRecord, why: str) -> None:
        name = record.endpoint_name
        if name is None:
            return
        self.metrics.upstream_failures.labels(name).inc()
        self.store.record_failure(name, why)
