"""OpenTelemetry spans of routed requests, exported over OTLP/HTTP to a real receiver on loopback."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from epp.observability.decision import DecisionLog, decision_trace
from epp.observability.tracing import SPAN_NAME, RequestTracer, otlp_tracer_provider
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext
from tests.epp.factories import FakeClock, endpoint_state, make_request, run
from tests.epp.latency_fakes import DECISION_CONFIG, QueuePredictor

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces receiver: decodes each POSTed ExportTraceServiceRequest."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.exports: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        self.received = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def spans(self) -> list[Any]:
        return [s for e in self.exports for r in e.resource_spans for ss in r.scope_spans for s in ss.spans]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.server.exports.append(export)
        self.server.content_types.append(self.headers["content-type"])
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
        self.server.received.set()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_one_span_per_request_with_its_decision_and_the_trace_context_for_the_engine(
    receiver: Receiver,
) -> None:
    clock = FakeClock(1000.0)
    provider = otlp_tracer_provider(receiver.url, "llm-epp-test")
    context = PluginContext(clock=clock, latency_predictor=QueuePredictor())
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(DECISION_CONFIG), context)
    tracer = RequestTracer(provider, clock, wall_clock_ns=lambda: 1_700_000_000 * 10**9 + int(clock() * 1e9))
    lifecycle = RequestLifecycle(pipeline, [DecisionLog(), tracer])
    client_context = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    request = dataclasses.replace(
        make_request(list(range(20)), model="chat"), stream=True, slo_ttft_ms=300.0, headers=client_context
    )
    endpoints = [endpoint_state(0, waiting=5), endpoint_state(1)]
    clock.now = 1000.010  # scheduling started at 1000.002 and has taken until now
    routed = run(lifecycle.route(request, endpoints, 1000.0, 1000.002))
    upstream = lifecycle.upstream_headers(routed)
    lifecycle.first_token(routed, 1000.150)
    clock.now = 1000.500
    lifecycle.finished(routed, 1000.500, status=200, completed=True, streaming=True, completion_tokens=9)
    provider.force_flush()
    assert receiver.received.wait(10)
    provider.shutdown()

    (span,) = receiver.spans()
    assert receiver.content_types == ["application/x-protobuf"]
    assert span.name == SPAN_NAME
    # A child of the client's span, and the engine gets this span as its parent.
    assert span.trace_id.hex() == CLIENT_TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN_ID
    assert upstream == {"traceparent": f"00-{CLIENT_TRACE_ID}-{span.span_id.hex()}-01"}
    # From the time the EPP received the request to its end, on the wall clock.
    assert span.start_time_unix_nano == pytest.approx(1_700_001_000 * 10**9, abs=1e3)
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(0.5e9, abs=1e3)
    attributes = _attributes(span)
    decision = decision_trace(routed)
    assert attributes["gen_ai.request.model"] == "chat"
    assert attributes["llm_epp.profile"] == "default"
    assert attributes["llm_epp.candidates"] == 2
    assert attributes["llm_epp.endpoint"] == "e1" == decision["picked"]
    assert (
        attributes["llm_epp.predicted_ttft_ms"] == 100.0 and attributes["llm_epp.predicted_tpot_ms"] == 10.0
    )
    assert attributes["llm_epp.model_version"] == 3 and "llm_epp.fallback" not in attributes
    assert attributes["llm_epp.scheduling_ms"] == pytest.approx(8.0)
    assert json.loads(attributes["llm_epp.decision"]) == decision
    assert attributes["http.response.status_code"] == 200 and attributes["llm_epp.ttft_ms"] == 150.0
    resource = {
        kv.key: kv.value.string_value for kv in receiver.exports[0].resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "llm-epp-test"


def test_a_request_without_predictions_names_its_fallback_and_starts_a_new_trace(receiver: Receiver) -> None:
    clock = FakeClock(5.0)
    provider = otlp_tracer_provider(receiver.url, "llm-epp")
    context = PluginContext(clock=clock, latency_predictor=QueuePredictor())
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(DECISION_CONFIG), context)
    lifecycle = RequestLifecycle(pipeline, [RequestTracer(provider, clock)])
    request = dataclasses.replace(make_request([1, 2, 3]), prediction_based=False)
    routed = run(lifecycle.route(request, [endpoint_state(0)], 5.0, 5.0))
    lifecycle.finished(routed, 5.2, status=None, completed=False, streaming=False, completion_tokens=None)
    provider.force_flush()
    assert receiver.received.wait(10)
    provider.shutdown()
    (span,) = receiver.spans()
    attributes = _attributes(span)
    assert attributes["llm_epp.fallback"] == "disabled" and "llm_epp.predicted_ttft_ms" not in attributes
    assert not span.parent_span_id and span.status.code == span.status.STATUS_CODE_ERROR
    assert lifecycle.upstream_headers(routed)["traceparent"].split("-")[1] == span.trace_id.hex()
