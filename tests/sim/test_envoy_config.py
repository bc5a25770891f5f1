"""The generated Envoy bootstrap, checked by the real Envoy binary: it validates, and Envoy's
own replies (no route, a wrong method, no upstream, headers over its limits) come in the OpenAI
error shape, typed as the openai SDK names the status's exception."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sim.envoy_config import (
    CODEC_MAX_HEADERS,
    CODEC_MAX_HEADERS_KB,
    ERROR_TYPES,
    EXT_PROC_HEALTH_SERVICE,
    gateway_bootstrap,
    with_epp_replicas,
    write_cluster_endpoints,
)
from sim.processes import free_port, start_envoy
from tests.epp.envoy_check import validate_bootstrap


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
def test_envoy_validates_the_bootstrap(tmp_path: Path, mode: str) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    bootstrap = gateway_bootstrap(
        listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints, failure_mode=mode
    )
    validate_bootstrap(tmp_path, bootstrap)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][1]
    assert ext_proc["typed_config"]["failure_mode_allow"] is (mode == "FailOpen")
    # Off on the listener, on for the inference API routes only.
    assert ext_proc["disabled"] is True
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    # POST paths (picked, not picked, wrong method), GET paths (the same), any other path.
    assert [ext_proc["name"] in r.get("typed_per_filter_config", {}) for r in routes] == [
        *[True, True, False] * 2,
        False,
    ]
    # Envoy's own answers (405, 404) wait for the request's end.
    assert [
        r.get("direct_response", {}).get("status")
        for r in routes
        if "envoy.filters.http.buffer" in r.get("typed_per_filter_config", {})
    ] == [405, 405, 404]
    assert ext_proc["typed_config"]["request_attributes"] == ["source.address"]


@pytest.mark.parametrize(("body_mode", "trailers"), [("BUFFERED", "SKIP"), ("FULL_DUPLEX_STREAMED", "SEND")])
def test_envoy_validates_each_request_body_mode(tmp_path: Path, body_mode: str, trailers: str) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    bootstrap = gateway_bootstrap(
        listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints, body_mode=body_mode
    )
    validate_bootstrap(tmp_path, bootstrap)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mode = hcm["http_filters"][1]["typed_config"]["processing_mode"]
    assert (mode["request_body_mode"], mode["request_trailer_mode"]) == (body_mode, trailers)


def test_fail_open_refuses_streamed_request_bodies(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="BUFFERED"):
        gateway_bootstrap(
            listen_port=1,
            epp_address=("127.0.0.1", 2),
            endpoints_file=tmp_path / "e.json",
            failure_mode="FailOpen",
            body_mode="FULL_DUPLEX_STREAMED",
        )


def test_envoy_validates_the_bootstrap_without_an_epp(tmp_path: Path) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    validate_bootstrap(
        tmp_path, gateway_bootstrap(listen_port=18081, epp_address=None, endpoints_file=endpoints)
    )


def test_api_paths_must_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        gateway_bootstrap(
            listen_port=1, epp_address=None, endpoints_file=tmp_path / "e.json", api_paths=["v1/x"]
        )


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway without an EPP whose one model server (and an extra API path) has nothing listening."""
    workdir = tmp_path_factory.mktemp("gateway")
    endpoints = write_cluster_endpoints(workdir / "eds" / "endpoints.json", [("127.0.0.1", free_port())])
    port = free_port()
    bootstrap = gateway_bootstrap(
        listen_port=port,
        epp_address=None,
        endpoints_file=endpoints,
        api_paths=["/v1/completions", "/v1/embeddings"],
    )
    envoy = start_envoy("envoy", bootstrap, workdir)
    yield f"http://127.0.0.1:{port}"
    envoy.stop()


def _error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body == {
        "error": {"message": body["error"]["message"], "type": error_type, "param": None, "code": status}
    }
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/metrics", "/health", "/v1/chat/completions", "/v1/completions/x", "/"])
def test_other_paths_get_a_json_404(gateway: str, path: str) -> None:
    message = _error(httpx.get(gateway + path, timeout=5), 404, "NotFoundError")
    assert message == "not an inference API path; this gateway serves /v1/completions, /v1/embeddings"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings?x=1"])
def test_an_unreachable_model_server_gets_a_json_503(gateway: str, path: str) -> None:
    message = _error(
        httpx.post(gateway + path, json={"x": '"quoted"\n'}, timeout=5), 503, "ServiceUnavailableError"
    )
    # Envoy's own text, escaped into JSON; and the request was retried before giving up.
    assert message.startswith("upstream connect error or disconnect/reset before headers. retried")


@pytest.mark.parametrize(
    "headers",
    [{"x-big": "a" * ((CODEC_MAX_HEADERS_KB + 1) << 10)}, {f"x-h{i}": "a" for i in range(CODEC_MAX_HEADERS)}],
)
def test_headers_over_envoys_limits_get_a_json_431(gateway: str, headers: dict[str, str]) -> None:
    response = httpx.post(gateway + "/v1/completions", json={}, headers=headers, timeout=5)
    assert _error(response, 431, "RequestHeaderFieldsTooLargeError") == "Request Header Fields Too Large"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "PATCH"])
def test_a_wrong_method_gets_a_json_405_naming_the_right_one(gateway: str, method: str) -> None:
    response = httpx.request(method, gateway + "/v1/completions", timeout=5)
    message = _error(response, 405, "MethodNotAllowedError")
    assert message == "method not allowed: /v1/completions, /v1/embeddings take POST only"
    assert response.headers["allow"] == "POST"


def test_http_1_0_is_served(gateway: str) -> None:
    port = int(gateway.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    # No model server listens: Envoy's JSON 503 after trying, not a 426 for the protocol.
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 503") and b'"ServiceUnavailableError"' in body


@pytest.mark.parametrize("status", [400, 403, 404, 500])
def test_error_types_are_the_openai_sdks_exception_names(status: int) -> None:
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1/v1")
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
    error = client._make_status_error("m", body=None, response=httpx.Response(status, request=request))
    assert ERROR_TYPES[status] == type(error).__name__


def test_envoy_validates_a_health_checked_ext_proc_cluster_of_two_epps(tmp_path: Path) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    single = gateway_bootstrap(listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints)
    bootstrap = with_epp_replicas(single, [("127.0.0.1", 19002, 19003), ("127.0.0.1", 19012, 19013)])
    validate_bootstrap(tmp_path, bootstrap)
    [epp] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp"]
    hosts = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["health_check_config"]["port_value"] for h in hosts] == [19003, 19013]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_HEALTH_SERVICE
    assert "outlier_detection" in epp and "typed_extension_protocol_options" in epp  # still HTTP/2
    [single_epp] = [c for c in single["static_resources"]["clusters"] if c["name"] == "epp"]
    assert "health_checks" not in single_epp  # the input is left as it was


def _access_logs(bootstrap: dict) -> list[dict]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm.get("access_log", [])


def test_envoy_validates_the_access_log_to_one_epp_and_to_each_of_several(tmp_path: Path) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    plain = gateway_bootstrap(listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints)
    assert _access_logs(plain) == []
    single = gateway_bootstrap(
        listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints, access_log_to_epp=True
    )
    validate_bootstrap(tmp_path, single)
    [logger] = _access_logs(single)
    config = logger["typed_config"]
    assert config["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp"
    assert config["additional_request_headers_to_log"] == ["x-request-id"]
    assert logger["filter"]["header_filter"]["header"]["name"] == "x-gateway-destination-endpoint"
    replicas = with_epp_replicas(single, [("127.0.0.1", 19002, 19003), ("127.0.0.1", 19012, 19013)])
    validate_bootstrap(tmp_path, replicas)
    clusters = {c["name"]: c for c in replicas["static_resources"]["clusters"]}
    names = [
        log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        for log in _access_logs(replicas)
    ]
    assert names == ["epp-log-0", "epp-log-1"]
    ports = [
        clusters[n]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"
        ]["port_value"]
        for n in names
    ]
    assert ports == [19002, 19012]
    assert [
        log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        for log in _access_logs(single)
    ] == ["epp"]
    # Told the replicas' ids, each logger keeps the entries its replica routed.
    owned = with_epp_replicas(
        single, [("127.0.0.1", 19002, 19003), ("127.0.0.1", 19012, 19013)], replica_ids=["a", "b"]
    )
    validate_bootstrap(tmp_path, owned)
    for log, replica in zip(_access_logs(owned), ("a", "b"), strict=True):
        routed, own = log["filter"]["and_filter"]["filters"]
        assert routed == logger["filter"]
        assert own["header_filter"]["header"] == {
            "name": "x-llm-epp-replica",
            "string_match": {"exact": replica},
        }
