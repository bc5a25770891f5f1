"""OpenTelemetry traces: one span per routed request, exported over OTLP/HTTP (off by default).

:class:`RequestTracer` is a lifecycle observer. When a request is routed it starts a span
``llm-epp.request`` (from the time the EPP received it to its last response byte), a child of
the client's W3C ``traceparent`` if it sent one, and gives the engine a ``traceparent`` naming
that span (an upstream request header), so an engine that traces (vLLM's
``--otlp-traces-endpoint``) joins the same trace. Attributes:

==============================  ====================================================
``gen_ai.request.model``        the model requested
``llm_epp.profile``             the scheduling profile
``llm_epp.candidates``          endpoints the cycle started with
``llm_epp.endpoint``            the chosen endpoint (``server.address`` its address)
``llm_epp.predicted_ttft_ms``   the chosen endpoint's predictions (when predicted)
``llm_epp.predicted_tpot_ms``
``llm_epp.model_version``       the latency model's version
``llm_epp.fallback``            why it was scheduled without predictions, if so
``llm_epp.scheduling_ms``       time spent choosing the endpoint
``llm_epp.decision``            the whole decision trace (``epp.observability.decision``), JSON
``http.response.status_code``   and ``llm_epp.ttft_ms`` once the request ended
==============================  ====================================================

Spans are batched and exported in a background thread (the SDK's ``BatchSpanProcessor``), so
the event loop only builds them. Times: the lifecycle's clock is monotonic; spans take wall
time, so each is placed at ``wall now − (clock now − step time)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epp.latency.report import chosen_prediction
from epp.observability.decision import decision_trace, encode
from epp.scheduling.framework import DataKey, RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.types import EndpointState

SPAN_NAME = "llm-epp.request"
_SPAN: DataKey[Span] = DataKey("otel-span")
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_tracer_provider(endpoint: str, service_name: str) -> TracerProvider:
    """A provider exporting spans in batches to the OTLP/HTTP traces ``endpoint``
    (``http://collector:4318/v1/traces``)."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer(LifecycleObserver):
    def __init__(
        self,
        provider: trace.TracerProvider,
        clock: Callable[[], float],
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """``clock``: the lifecycle's clock (the times its steps carry)."""
        self.tracer = provider.get_tracer("llm-epp")
        self.clock = clock
        self.wall_clock_ns = wall_clock_ns

    def _wall_ns(self, at: float) -> int:
        return self.wall_clock_ns() - int((self.clock() - at) * 1e9)

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        request, state = routed.request, routed.state
        parent = _PROPAGATOR.extract(carrier=dict(request.headers))
        span = self.tracer.start_span(
            SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=self._wall_ns(routed.received_at)
        )
        decision = decision_trace(routed)
        endpoint = routed.booked.endpoint
        attributes: dict[str, str | int | float] = {
            "gen_ai.request.model": request.model,
            "llm_epp.request_id": request.request_id,
            "llm_epp.profile": routed.result.profile,
            "llm_epp.candidates": decision["candidates"],
            "llm_epp.endpoint": endpoint.name,
            "server.address": endpoint.address,
            "server.port": endpoint.port,
            "llm_epp.scheduling_ms": round((self.clock() - now) * 1e3, 3),
            "llm_epp.decision": encode(decision),
        }
        if (predicted := chosen_prediction(state, endpoint.name)) is not None:
            attributes["llm_epp.predicted_ttft_ms"] = predicted.ttft_ms
            attributes["llm_epp.predicted_tpot_ms"] = predicted.tpot_ms
        if (version := decision.get("model_version")) is not None:
            attributes["llm_epp.model_version"] = version
        if (fallback := decision.get("fallback")) is not None:
            attributes["llm_epp.fallback"] = fallback
        span.set_attributes(attributes)
        state.put(_SPAN, span)

    def on_rebooked(self, routed: RoutedRequest, previous: EndpointState, now: float) -> None:
        span = routed.state.get(_SPAN)
        if span is not None:
            span.set_attribute("llm_epp.endpoint", routed.endpoint_name)
            span.set_attribute("llm_epp.rebooked_from", previous.endpoint.name)

    def upstream_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        span = routed.state.get(_SPAN)
        if span is None:
            return {}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        span = routed.state.get(_SPAN)
        if span is None:
            return
        if outcome.status is not None:
            span.set_attribute("http.response.status_code", outcome.status)
        if outcome.ttft_s is not None:
            span.set_attribute("llm_epp.ttft_ms", round(outcome.ttft_s * 1e3, 3))
        if not outcome.completed:
            span.set_status(Status(StatusCode.ERROR, "aborted" if outcome.status is None else "failed"))
        span.end(end_time=self._wall_ns(outcome.finished_at))
