"""The gRPC floor servicer: its answers to the gateway's messages, and a request through real Envoy."""

from __future__ import annotations

import httpx
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from bench.harness.grpc_floor import FloorProcessor, floor_gateway
from bench.harness.stub_engine import stub_engine_bootstrap
from epp.extproc.messages import CONTINUE_SKIPPING_RESPONSE_BODY, DESTINATION_HEADER
from sim.envoy_config import write_cluster_endpoints
from sim.processes import free_port, start_envoy

HEADERS = ProcessingRequest(
    request_headers=HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=":path")]))
)
BODY = ProcessingRequest(request_body=HttpBody(body=b"{}", end_of_stream=True))
RESPONSE_HEADERS = ProcessingRequest(response_headers=HttpHeaders())


def _destination(reply) -> str:
    headers = reply.request_body.response.header_mutation.set_headers
    (value,) = [h.header.raw_value.decode() for h in headers if h.header.key == DESTINATION_HEADER]
    return value


def test_it_routes_bodies_to_its_targets_in_turn_and_ends_the_stream_at_the_response_headers():
    floor = FloorProcessor(["10.0.0.1:8000", "10.0.0.2:8000"])
    headers_reply, done = floor.reply(HEADERS)
    assert headers_reply.HasField("request_headers") and not done
    picks = []
    for _ in range(3):
        reply, done = floor.reply(BODY)
        assert not done
        picks.append(_destination(reply))
    assert picks == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.1:8000"]
    reply, done = floor.reply(RESPONSE_HEADERS)
    assert done
    assert reply.HasField("response_headers")
    assert reply == CONTINUE_SKIPPING_RESPONSE_BODY  # the body of a non-streamed response is skipped


def test_without_targets_it_continues_chunks_and_refuses_a_body_it_cannot_route():
    floor = FloorProcessor([])
    chunk, done = floor.reply(ProcessingRequest(response_body=HttpBody(body=b"data: x\n\n")))
    assert chunk.HasField("response_body") and not done
    with pytest.raises(ValueError, match="no target"):
        floor.reply(BODY)


@pytest.mark.integration
def test_requests_through_the_gateway_reach_each_replica_in_turn(tmp_path):
    ports = [free_port(), free_port()]
    admin = free_port()
    engines = start_envoy(
        "stub-engines", stub_engine_bootstrap(ports), tmp_path, admin_port=admin, concurrency=1
    )
    try:
        endpoints = write_cluster_endpoints(
            tmp_path / "cluster" / "endpoints.json", [("127.0.0.1", p) for p in ports]
        )
        with floor_gateway(ports, endpoints, tmp_path) as gateway:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
            answers = [httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10) for _ in range(4)]
            assert [a.status_code for a in answers] == [200] * 4
            assert all(a.json()["id"] == "cmpl-stub" for a in answers)
        stats = httpx.get(f"http://127.0.0.1:{admin}/stats?format=json&filter=downstream_rq_2xx").json()
        served = {s["name"]: s["value"] for s in stats["stats"] if s["name"].startswith("http.stub")}
        assert served == {f"http.stub{p}.downstream_rq_2xx": 2 for p in ports}
    finally:
        engines.stop()
