"""Envoy bootstrap for a gateway in front of the EPP (used by the local stack and tests).

The listener runs three HTTP filters: a header mutation that drops any client-supplied
destination header (so a client can never pick its own upstream), the ext_proc filter
talking to the EPP, and the router. Requests go to an ORIGINAL_DST cluster that connects
to whatever ``x-gateway-destination-endpoint`` says.

Failure mode (what happens when the EPP is down, slow, or errors):

* ``FailClose`` (default here and the InferencePool CRD default): ext_proc errors fail the
  request; the client gets an error (500 from Envoy; 503 if no route was chosen).
* ``FailOpen`` (the anchor Helm chart's default): Envoy skips the EPP and the request falls
  through to a plain round-robin cluster over ``fallback_endpoints``. Traffic keeps flowing
  with no load or cache awareness. With no fallback endpoints, fail-open has nowhere to go.
  Envoy can only fail open while it still holds the request body, and in FULL_DUPLEX_STREAMED
  mode it hands the first chunk to the EPP before it learns the EPP is down (requests with a
  body then get a 500: the "gateways ignore FailOpen" bug). So fail-open gateways use BUFFERED
  request bodies (sent without waiting for the headers reply, so it costs no extra round
  trip), up to ``max_request_bytes``; fail-closed ones stream in FULL_DUPLEX_STREAMED mode.

Without an EPP address the same gateway has no ext_proc filter at all and round-robins over
``fallback_endpoints``: the baseline the overhead benchmark compares against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

FailureMode = Literal["FailOpen", "FailClose"]
DESTINATION_HEADER = "x-gateway-destination-endpoint"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _static_cluster(name: str, endpoints: Sequence[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(a, p)}} for a, p in endpoints]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            _HTTP_OPTIONS: {
                "@type": _HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def ext_proc_filter(epp_cluster: str, failure_mode: FailureMode) -> dict[str, Any]:
    fail_open = failure_mode == "FailOpen"
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            "message_timeout": "5s",
            "send_body_without_waiting_for_header_response": True,
            # The EPP skips the response body of non-streamed requests per request.
            "allow_mode_override": True,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SKIP" if fail_open else "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def gateway_bootstrap(
    *,
    listen_port: int,
    epp_address: tuple[str, int] | None,
    failure_mode: FailureMode = "FailClose",
    fallback_endpoints: Sequence[tuple[str, int]] = (),
    listen_address: str = "127.0.0.1",
    max_request_bytes: int = 16 << 20,
) -> dict[str, Any]:
    """An Envoy v3 bootstrap (as a dict, dump it to YAML or JSON) for the gateway; add ``admin`` to taste."""
    with_epp = epp_address is not None
    fail_open = (failure_mode == "FailOpen" or not with_epp) and bool(fallback_endpoints)
    routed = {
        "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
        "route": {"cluster": "model_servers", "timeout": "0s", "idle_timeout": "600s"},
    }
    unrouted: dict[str, Any] = {"match": {"prefix": "/"}}
    if fail_open:
        unrouted["route"] = {"cluster": "fallback_model_servers", "timeout": "0s", "idle_timeout": "600s"}
    else:
        unrouted["direct_response"] = {
            "status": 503,
            "body": {"inline_string": '{"error": {"message": "no endpoint was picked", "code": 503}}'},
        }
    hcm = {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {
            "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [routed, unrouted] if with_epp else [unrouted]}
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": _HEADER_MUTATION,
                    "mutations": {"request_mutations": [{"remove": DESTINATION_HEADER}]},
                },
            },
            *([ext_proc_filter("epp", failure_mode)] if with_epp else []),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    clusters = []
    if epp_address is not None:
        clusters.append(_static_cluster("epp", [epp_address], http2=True))
        clusters.append(
            {
                "name": "model_servers",
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "2s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
            }
        )
    if fail_open:
        clusters.append(_static_cluster("fallback_model_servers", fallback_endpoints))
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _socket(listen_address, listen_port),
                    "per_connection_buffer_limit_bytes": max_request_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC health service an EPP reports SERVING for while it is ready to take ext_proc streams."""


def with_epp_replicas(bootstrap: dict[str, Any], replicas: Sequence[tuple[str, int, int]]) -> dict[str, Any]:
    """``bootstrap`` with its ext_proc cluster spread over active-active EPP replicas, each given as
    (address, ext_proc port, gRPC health port).

    Envoy health-checks every replica over gRPC on its health port (the ext_proc service's
    readiness, every 0.5 s, down after 2 failures) and ejects one whose streams fail (outlier
    detection: 2 local-origin failures, such as refused connections, or 3 gateway errors), so a
    dead or stopping replica gets no new streams within about a second. New streams are spread
    round-robin; the replicas keep one view of the load through ``epp.sync``."""
    clusters = bootstrap["static_resources"]["clusters"]
    [epp] = [c for c in clusters if c["name"] == "epp"]
    epp = {
        **epp,
        "load_assignment": {
            "cluster_name": "epp",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket(a, p), "health_check_config": {"port_value": h}}}
                        for a, p, h in replicas
                    ]
                }
            ],
        },
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "0.5s",
                "no_traffic_interval": "0.5s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_HEALTH_SERVICE},
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_gateway_failure": 3,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
    }
    resources = {
        **bootstrap["static_resources"],
        "clusters": [epp if c["name"] == "epp" else c for c in clusters],
    }
    return {**bootstrap, "static_resources": resources}
