"""ext_proc messages as Envoy sends them, and a director with its stream over a fake pool."""

from __future__ import annotations

import random
from collections.abc import Sequence

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProtocolConfiguration,
)
from prometheus_client import CollectorRegistry

from epp.configs import config_path
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.metrics import PoolMetrics
from epp.extproc.gate import DebugAccess, RequestGate
from epp.extproc.messages import (
    DESTINATION_HEADER,
    EXT_PROC_ATTRIBUTES,
    LB_METADATA_NAMESPACE,
    SOURCE_ATTRIBUTE,
)
from epp.extproc.stream import ExtProcStream
from epp.latency.metrics import PredictionMetrics
from epp.latency.report import PredictionReport
from epp.metrics import ModelLabels, RequestMetrics
from epp.plugins.token_load import find_token_load
from epp.requestcontrol.completion_log import MeteringSettings
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext
from epp.scheduling.observers import LifecycleObserver
from epp.scheduling.types import Endpoint, EngineMetrics
from epp.tokenizer.model import ModelTokenizer, PromptTokenizer
from sim.models import TINY_MODEL_DIR
from tests.epp.factories import FakeClock

LOCAL_CLIENT = "127.0.0.1:40000"
"""The client address :func:`headers_msg` sends by default (``source.address``), which the
harness's gate lets see decision traces."""


def headers_msg(
    path: str = "/v1/completions",
    method: str = "POST",
    eos: bool = False,
    buffered: bool = False,
    source: str | None = LOCAL_CLIENT,
    **extra: str,
):
    pairs = {":path": path, ":method": method, "content-type": "application/json", **extra}
    hm = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    mode = ProcessingMode.BUFFERED if buffered else ProcessingMode.FULL_DUPLEX_STREAMED
    message = ProcessingRequest(
        request_headers=HttpHeaders(headers=hm, end_of_stream=eos),
        protocol_config=ProtocolConfiguration(request_body_mode=mode),
    )
    if source is not None:
        message.attributes[EXT_PROC_ATTRIBUTES].update({SOURCE_ATTRIBUTE: source})
    return message


def body_msg(data: bytes, eos: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=eos))


def response_headers_msg(
    status: int = 200,
    content_type: str = "text/event-stream",
    extra: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    attributes: dict[str, str] | None = None,
    eos: bool = False,
) -> ProcessingRequest:
    """Response headers, with ``envoy.lb`` dynamic ``metadata`` and the ext_proc filter's
    response ``attributes`` when given."""
    fields = {":status": str(status), "content-type": content_type, **(extra or {})}
    hm = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in fields.items()])
    message = ProcessingRequest(response_headers=HttpHeaders(headers=hm, end_of_stream=eos))
    if metadata is not None:
        message.metadata_context.filter_metadata[LB_METADATA_NAMESPACE].update(metadata)
    if attributes is not None:
        message.attributes[EXT_PROC_ATTRIBUTES].update(attributes)
    return message


def response_body_msg(
    data: bytes, eos: bool, attributes: dict[str, object] | None = None
) -> ProcessingRequest:
    """A response body chunk, with the ext_proc filter's response ``attributes`` when given (as
    Envoy sends them with the first chunk of a response whose headers it skipped)."""
    message = ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=eos))
    if attributes is not None:
        message.attributes[EXT_PROC_ATTRIBUTES].update(attributes)
    return message


LOOPBACK_TRACES = RequestGate(debug=DebugAccess.from_settings(None, ["127.0.0.0/8"]))
"""Envoy's header limits, decision traces for loopback callers (the local stack's defaults)."""


class Harness:
    def __init__(
        self,
        healthy: int = 2,
        max_body: int = 1 << 20,
        config: str = "gie-default",
        tokenizer: PromptTokenizer | None = None,
        default_max_model_len: int | None = None,
        observers: Sequence[LifecycleObserver] = (),
        metering: MeteringSettings | None = None,
        gate: RequestGate = LOOPBACK_TRACES,
    ) -> None:
        self.gate = gate
        self.clock = FakeClock()
        self.store = EndpointStore()
        self.store.replace([Endpoint(f"e{i}", "10.0.0.1", 8000 + i) for i in range(2)])
        for i in range(healthy):
            self.store.record_scrape(f"e{i}", EngineMetrics(updated_at=self.clock()))
        context = PluginContext(clock=self.clock, rng=random.Random(1))
        pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path(config)), context)
        self.registry = CollectorRegistry()
        labels = ModelLabels()
        pool = PoolMetrics(self.registry, "pool", self.store, self.clock)
        token_load = find_token_load(pipeline.plugins.values())
        self.tracker = token_load.tracker if token_load is not None else None
        if self.tracker is not None:
            pool.export_token_load(self.tracker)
        lifecycle = RequestLifecycle(
            pipeline, [PredictionReport(PredictionMetrics(self.registry, labels)), *observers]
        )
        self.director = Director(
            lifecycle,
            self.store,
            tokenizer or ModelTokenizer(TINY_MODEL_DIR),
            RequestMetrics(self.registry, labels),
            self.clock,
            random.Random(1),
            default_max_model_len=default_max_model_len,
            metering=metering,
        )
        self.max_body = max_body

    def stream(self) -> ExtProcStream:
        return ExtProcStream(self.director, self.max_body, self.gate)

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.store.all())


def routed_destination(reply) -> str:
    common = (
        reply.request_headers.response if reply.HasField("request_headers") else reply.request_body.response
    )
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    lb = reply.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_HEADER]
    assert common.clear_route_cache
    assert lb.string_value.split(",")[0] == headers[DESTINATION_HEADER]
    return headers[DESTINATION_HEADER]
