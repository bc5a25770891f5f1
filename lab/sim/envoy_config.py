"""Envoy bootstrap for a gateway in front of the EPP (used by the local stack, tests and benchmarks).

The listener runs these HTTP filters: a header mutation that drops any client-supplied
destination header (so a client can never pick its own upstream) or replica id, the filter that
asks the EPP (ext_proc, or ext_authz with ``ext_authz_port``), and the router; with the access
log to the EPP, a Lua filter first that marks streamed answers for it.

Routes: only the inference API paths (``INFERENCE_API_PATHS`` by default) go to the model
servers, each with the one method it takes (``GET_PATHS`` GET, the others POST; any other
method gets a JSON 405); any other path gets a JSON 404 from Envoy without asking the EPP, so
the engines' own endpoints (``/metrics``, ``/health``, ...) are not reachable through the gateway.

Request headers: Envoy's limits (``CODEC_MAX_HEADERS``, ``CODEC_MAX_HEADERS_KB``) sit above the
ones the EPP enforces with a JSON 431, which leave room for the headers the EPP adds (see
``epp.extproc.gate``). HTTP/1.0 requests are served (``accept_http_10``).

Upstream: one EDS cluster of the model servers, read from a file (:func:`write_cluster_endpoints`,
reloaded when it is replaced), balanced by Envoy's ``override_host`` policy. The EPP's picks
arrive in ``envoy.lb`` dynamic metadata (``x-gateway-destination-endpoint``: the target, then
fallbacks); Envoy sends the request to the first and each retry to the next, and round-robins
over the cluster (skipping hosts already tried) when the list is used up or absent. A request
is retried, up to ``RETRIES`` times, when it never got a response byte: connect failure,
refused stream, or a reset before the response headers. Envoy closes idle upstream
connections after ``UPSTREAM_IDLE_TIMEOUT``, before the engines do (uvicorn's, and so vLLM's,
keep-alive is 5 s): an engine closing a connection just as Envoy sends a request on it would
otherwise fail that request. In Kubernetes the gateway builds this cluster itself from the
InferencePool (GKE, Istio and kgateway watch the pool's pods), so only the local stack writes
the file.

Errors Envoy answers itself (no route, upstream connect failure or reset, no healthy
upstream, timeouts, headers over Envoy's limits, an unreachable EPP in ``FailClose`` mode)
are rewritten by ``local_reply_config`` to the OpenAI/vLLM JSON shape
``{"error": {"message", "type", "param", "code"}}`` that the EPP and vLLM use, typed by
``ERROR_TYPES``; replies that already are JSON (the EPP's own errors) pass unchanged.

Failure mode (what happens when the EPP is down, slow, or errors):

* ``FailClose`` (default here and the InferencePool CRD default): ext_proc errors fail the
  request; the client gets an error (500 from Envoy; 503 if no route was chosen).
* ``FailOpen`` (the anchor Helm chart's default): Envoy skips the EPP and the request goes to
  the model servers round-robin: traffic keeps flowing with no load or cache awareness.
  Envoy can only fail open while it still holds the request body, and in FULL_DUPLEX_STREAMED
  mode it hands the first chunk to the EPP before it learns the EPP is down (requests with a
  body then get a 500: the "gateways ignore FailOpen" bug), so fail-open gateways need BUFFERED.

Request bodies (``body_mode``): BUFFERED by default in both failure modes. Envoy holds the body
(up to ``max_request_bytes``) and sends it whole once the EPP answered the headers (at once;
waiting for that answer is what lets the EPP skip a response body, see
:func:`ext_proc_filter`); the EPP never changes the body, so its reply carries no body at all.
FULL_DUPLEX_STREAMED (what the anchor's gateways configure, and the EPP serves too) makes the
EPP collect the body and send every byte back: on a 110 KB (26k-token) body that is twice the
EPP's gRPC CPU for the request (0.85 against 0.45 ms), and Envoy CPU besides.

Access log to the EPP (``access_log_to_epp``, for the EPP's ``--response-metering
first-token``): every request the EPP routed is logged over gRPC (``envoy.access_loggers.http_grpc``)
to the EPP's own port, batched for at most ``ACCESS_LOG_FLUSH``, with the request id as forwarded;
a stream still open is logged every ``ACCESS_LOG_PERIOD`` as well, so the EPP can tell a long
stream from a lost entry. A Lua filter marks a streamed answer whose ``data: [DONE]`` reached
the client (dynamic metadata ``llm_epp.sse_done``, which the entry carries): the openai SDK
hangs up on reading it, often before the engine's end of body reaches Envoy, and Envoy then
logs a client that went away. With several EPP replicas each one gets every entry (a logger per
replica, :func:`with_epp_replicas`): a replica finishes the requests it handed off and counts
the others' as unknown.

Without an EPP address the same gateway has no ext_proc filter at all and round-robins over
the model servers: the baseline the overhead benchmark compares against.

TLS to the EPP (:class:`EppTls`): Envoy verifies the EPP's certificate against a CA file and
its name (SNI and a SAN match), and with a client certificate it can answer an EPP that
requires mTLS. A handshake that fails is an unreachable EPP, so the failure mode decides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from epp.extauthz.check import CHECK_PATH_PREFIX, SOURCE_HEADER
from epp.extauthz.server import READY_PATH
from epp.extproc.envoy_contract import (
    EXT_PROC_HEALTH_SERVICE,
    FIRST_BODY_BYTE_METADATA,
    INFERENCE_API_PATHS,
    MAX_MESSAGE_TIMEOUT_S,
    MESSAGE_TIMEOUT_S,
    SSE_DONE_METADATA,
    SSE_EVENTS_METADATA,
)
from epp.extproc.messages import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    RESPONSE_CODE_ATTRIBUTE,
    SERVED_BY_ATTRIBUTE,
    SOURCE_ATTRIBUTE,
)
from epp.requestcontrol.director import REQUEST_ID_HEADER
from epp.sync.replica_header import REPLICA_HEADER

FailureMode = Literal["FailOpen", "FailClose"]
BodyMode = Literal["BUFFERED", "FULL_DUPLEX_STREAMED"]
Callout = Literal["ext-proc", "ext-authz"]
"""How the gateway asks the EPP: an ext_proc stream per request, or one HTTP ext_authz check."""
MODEL_SERVERS_CLUSTER = "model_servers"
UPSTREAM_IDLE_TIMEOUT = "3s"
RETRIES = 2
CODEC_MAX_HEADERS = 160
CODEC_MAX_HEADERS_KB = 96
"""Envoy's own limits on request headers (``max_headers_count``, ``max_request_headers_kb``),
kept above those the EPP enforces (``epp.extproc.gate``: Envoy's defaults, 100 and 60 KiB) so
that the EPP's JSON 431 comes first: over HTTP/2 Envoy answers headers over its own limits with
a stream reset, not a 431."""
GET_PATHS = ("/v1/models",)
"""The API paths read with GET; the others take POST. Any other method gets a JSON 405."""

# The error ``type`` for each status Envoy answers with: for 400, 403, 404 and 500 the openai
# SDK's exception class name (what a client catches), else the status's phrase in that style,
# as the EPP names its own (429 TooManyRequestsError, 503 ServiceUnavailableError).
ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "PayloadTooLargeError",
    426: "UpgradeRequiredError",
    429: "TooManyRequestsError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
_OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_LOAD_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
_EXT_AUTHZ = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_EXT_AUTHZ_FILTER = "envoy.filters.http.ext_authz"
EXT_AUTHZ_CLUSTER = "epp_ext_authz"
TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace context the EPP may add to a forwarded request."""
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_RAW_BUFFER = "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_BUFFER_FILTER = "envoy.filters.http.buffer"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
_HTTP_GRPC_LOG = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
ACCESS_LOG_FLUSH = "0.1s"
"""The most an access-log entry waits in Envoy's batch before it goes to the EPP."""
ACCESS_LOG_PERIOD = "10s"
"""How often Envoy logs a stream still open (``access_log_flush_interval``); the EPP's
``--completion-log-silence-s`` must exceed it."""
_PLAINTEXT_HEALTH = {"llm_epp_health": "plaintext"}
"""Transport-socket match of the health checks: the EPP's health port is plaintext."""


@dataclass(frozen=True)
class EppTls:
    """How the gateway connects to a TLS EPP."""

    ca_file: Path
    """PEM CA bundle the EPP's certificate must chain to."""
    server_name: str
    """Sent as SNI; the certificate must carry it as a DNS SAN."""
    client_cert_file: Path | None = None
    """The gateway's own certificate, for an EPP that requires client certificates (mTLS)."""
    client_key_file: Path | None = None


def _epp_transport_socket(tls: EppTls) -> dict[str, Any]:
    context: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": str(tls.ca_file)},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": tls.server_name}}],
        },
    }
    if tls.client_cert_file is not None and tls.client_key_file is not None:
        context["tls_certificates"] = [
            {
                "certificate_chain": {"filename": str(tls.client_cert_file)},
                "private_key": {"filename": str(tls.client_key_file)},
            }
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {"@type": _UPSTREAM_TLS, "sni": tls.server_name, "common_tls_context": context},
    }


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _load_assignment(name: str, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(a, p)}} for a, p in endpoints]}],
    }


def write_cluster_endpoints(path: Path, endpoints: Sequence[tuple[str, int]]) -> Path:
    """Atomically (re)write the model-server cluster's endpoints file that Envoy watches.

    Envoy reloads it when it is replaced by a rename, so a running gateway follows the change.
    Envoy watches the file's whole directory: give it a directory of its own (it is created),
    not one where logs are written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    response = {
        "resources": [{"@type": _LOAD_ASSIGNMENT, **_load_assignment(MODEL_SERVERS_CLUSTER, endpoints)}]
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(response))
    tmp.replace(path)
    return path


def _epp_cluster(address: tuple[str, int], tls: EppTls | None) -> dict[str, Any]:
    return {
        "name": "epp",
        **({"transport_socket": _epp_transport_socket(tls)} if tls is not None else {}),
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": _load_assignment("epp", [address]),
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                "@type": _HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def _spread(
    cluster: dict[str, Any], replicas: Sequence[tuple[str, int, int | None]], ready_path: str | None = None
) -> dict[str, Any]:
    """``cluster`` over the EPP replicas (address, port, gRPC health port), health-checked and
    with failing ones ejected (see :func:`with_epp_replicas`). With ``ready_path`` the health
    check is an HTTP GET of it on the port itself (an HTTP/1.1 cluster cannot check gRPC)."""
    name, tls = cluster["name"], "transport_socket" in cluster
    check = (
        {"http_health_check": {"path": ready_path}}
        if ready_path is not None
        else {"grpc_health_check": {"service_name": EXT_PROC_HEALTH_SERVICE}}
    )
    return {
        **cluster,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": _socket(a, p),
                                **({"health_check_config": {"port_value": h}} if h is not None else {}),
                            }
                        }
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
                **check,
                **({"transport_socket_match_criteria": _PLAINTEXT_HEALTH} if tls else {}),
            }
        ],
        **(
            {
                "transport_socket_matches": [
                    {
                        "name": "plaintext-health",
                        "match": _PLAINTEXT_HEALTH,
                        "transport_socket": {
                            "name": "envoy.transport_sockets.raw_buffer",
                            "typed_config": {"@type": _RAW_BUFFER},
                        },
                    }
                ]
            }
            if tls
            else {}
        ),
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_gateway_failure": 3,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
    }


def _ext_authz_cluster(address: str, port: int) -> dict[str, Any]:
    """The EPP's ext_authz port: HTTP/1.1, kept-alive connections."""
    return {
        "name": EXT_AUTHZ_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": _load_assignment(EXT_AUTHZ_CLUSTER, [(address, port)]),
    }


def _epp_filter(
    failure_mode: FailureMode, body_mode: BodyMode, max_request_bytes: int, authz: bool
) -> dict[str, Any]:
    if authz:
        return ext_authz_filter(failure_mode, max_request_bytes)
    return ext_proc_filter("epp", failure_mode, body_mode)


def _lb_policy(name: str, typed_config: dict[str, Any]) -> dict[str, Any]:
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": typed_config}}]}


def model_servers_cluster(endpoints_file: Path, picks_in_header: bool = False) -> dict[str, Any]:
    """The model servers, from ``endpoints_file``, balanced by the EPP's picks (see the module
    doc): from ``envoy.lb`` metadata (ext_proc), or from the destination header, which then
    holds the whole list (ext_authz answers with headers only)."""
    source = (
        {"header": DESTINATION_HEADER}
        if picks_in_header
        else {"metadata": {"key": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
    )
    return {
        "name": MODEL_SERVERS_CLUSTER,
        "type": "EDS",
        "eds_cluster_config": {
            "eds_config": {"path_config_source": {"path": str(endpoints_file)}, "resource_api_version": "V3"}
        },
        "connect_timeout": "2s",
        "load_balancing_policy": _lb_policy(
            "envoy.load_balancing_policies.override_host",
            {
                "@type": _OVERRIDE_HOST,
                # One source only: with ext_proc the header repeats the first pick, and Envoy
                # would append it to the list, retrying the first pick again.
                "override_host_sources": [source],
                "fallback_policy": _lb_policy(
                    "envoy.load_balancing_policies.round_robin", {"@type": _ROUND_ROBIN}
                ),
            },
        ),
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                "@type": _HTTP_OPTIONS_TYPE,
                "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        # Envoy's default allows 3 retries in flight per cluster; a replica that stalls under
        # load can leave more requests than that to retry at once.
        "circuit_breakers": {
            "thresholds": [{"retry_budget": {"budget_percent": {"value": 25.0}, "min_retry_concurrency": 16}}]
        },
    }


def ext_proc_filter(
    epp_cluster: str, failure_mode: FailureMode, body_mode: BodyMode = "BUFFERED"
) -> dict[str, Any]:
    fail_open = failure_mode == "FailOpen"
    if fail_open and body_mode != "BUFFERED":
        raise ValueError("FailOpen needs BUFFERED request bodies (see the module doc)")
    return {
        "name": _EXT_PROC_FILTER,
        "typed_config": {
            "@type": _EXT_PROC,
            # Flow control holds a request past message_timeout: the EPP then asks for up to this.
            "max_message_timeout": f"{MAX_MESSAGE_TIMEOUT_S}s",
            "grpc_service": {"envoy_grpc": {"cluster_name": epp_cluster}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            "message_timeout": f"{MESSAGE_TIMEOUT_S}s",
            # Off, so that Envoy honours the EPP's mode_override: the response headers reply skips
            # the body of a non-streamed response (two messages each way fewer per request), at
            # the cost of one EPP round trip before Envoy sends the request body.
            "send_body_without_waiting_for_header_response": False,
            # Envoy drops the EPP's dynamic metadata (its picks) unless the namespace is listed.
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
            "allow_mode_override": True,
            # The client's address: who may see decision traces (--decision-trace-from).
            "request_attributes": [SOURCE_ATTRIBUTE],
            # The endpoint that answered, after any retry, for the EPP to book the request on,
            # and the status: with the first body chunk when the EPP asked for no headers.
            "response_attributes": [SERVED_BY_ATTRIBUTE, RESPONSE_CODE_ATTRIBUTE],
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": body_mode,
                # A streamed body may end with trailers; a buffered one is sent whole first.
                "request_trailer_mode": "SKIP" if body_mode == "BUFFERED" else "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SKIP",
            },
        },
    }


def ext_authz_filter(failure_mode: FailureMode, max_request_bytes: int) -> dict[str, Any]:
    """The HTTP ext_authz filter that asks the EPP (``EXT_AUTHZ_CLUSTER``) for each request's
    pick: every client header and the whole body go to it (``epp.extauthz.check``); its answer's
    destination, request id and trace context go upstream, a refusal's status, body and headers
    to the client, and a decision trace onto the client's response."""
    upstream = (DESTINATION_HEADER, REQUEST_ID_HEADER, REPLICA_HEADER, *TRACE_HEADERS)
    exact = [{"exact": name} for name in upstream]
    return {
        "name": _EXT_AUTHZ_FILTER,
        "typed_config": {
            "@type": _EXT_AUTHZ,
            "http_service": {
                "server_uri": {
                    "uri": f"http://{EXT_AUTHZ_CLUSTER}",
                    "cluster": EXT_AUTHZ_CLUSTER,
                    # Flow control may hold a request up to its band's TTL.
                    "timeout": f"{MAX_MESSAGE_TIMEOUT_S}s",
                },
                "path_prefix": CHECK_PATH_PREFIX,
                "authorization_request": {
                    # Replaces any such header from the client: who may see decision traces.
                    "headers_to_add": [
                        {"key": SOURCE_HEADER, "value": "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"}
                    ],
                },
                "authorization_response": {
                    "allowed_upstream_headers": {"patterns": exact},
                    "allowed_client_headers": {
                        "patterns": [
                            {"exact": "content-type"},
                            {"exact": "retry-after"},
                            {"prefix": "x-llm-d-"},
                        ]
                    },
                    "allowed_client_headers_on_success": {"patterns": [{"prefix": "x-llm-epp-"}]},
                },
            },
            "allowed_headers": {"patterns": [{"safe_regex": {"regex": ".*"}}]},
            "with_request_body": {"max_request_bytes": max_request_bytes, "pack_as_bytes": True},
            "clear_route_cache": True,
            "failure_mode_allow": failure_mode == "FailOpen",
            # As ext_proc's failures: a 500 (the local reply names the EPP).
            "status_on_error": {"code": 500},
        },
    }


def _error_body(error_type: str) -> dict[str, Any]:
    error = {
        "message": "%LOCAL_REPLY_BODY%",
        "type": error_type,
        # A key nothing sets: Envoy renders it as JSON null.
        "param": "%DYNAMIC_METADATA(llm_epp.unset:param)%",
        "code": "%RESPONSE_CODE%",
    }
    return {"json_format": {"error": error}, "content_type": "application/json"}


def _status_is(op: str, status: int) -> dict[str, Any]:
    comparison = {
        "op": op,
        "value": {"default_value": status, "runtime_key": f"llm_epp.local_reply.{status}"},
    }
    return {"status_code_filter": {"comparison": comparison}}


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": _CEL_FILTER, "expression": expression},
        }
    }


def local_reply_config() -> dict[str, Any]:
    """Envoy's own replies in the OpenAI/vLLM error shape; JSON replies (the EPP's) unchanged.

    ``json_format`` escapes the original text (``%LOCAL_REPLY_BODY%``) into the message. The
    ext_proc filter's own errors (the EPP unreachable, or silent past ``message_timeout``)
    have no text, so they get one.
    """
    unchanged = {
        "text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
        "content_type": "application/json",
    }
    mappers: list[dict[str, Any]] = [
        {
            "filter": _cel("response.headers['content-type'].startsWith('application/json')"),
            "body_format_override": unchanged,
        }
    ]
    # ext_proc_error_* (the stream failed or timed out), and any other ext_proc failure.
    epp_failed = {
        "or_filter": {
            "filters": [
                _cel("response.code_details.startsWith('ext_proc')"),
                _cel("response.code_details.startsWith('ext_authz')"),
            ]
        }
    }
    for status, message in ((500, "the endpoint picker failed"), (504, "the endpoint picker timed out")):
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [epp_failed, _status_is("EQ", status)]}},
                "body": {"inline_string": message},
                "body_format_override": _error_body(ERROR_TYPES[status]),
            }
        )
    # Envoy refuses an upgrade it was not configured for (websocket, ...) with a 403 and no text.
    mappers.append(
        {
            "filter": _cel("response.code_details.startsWith('upgrade')"),
            "body": {
                "inline_string": "protocol upgrades are not served here: send the request without Upgrade"
            },
            "body_format_override": _error_body(ERROR_TYPES[403]),
        }
    )
    mappers += [
        {"filter": _status_is("EQ", status), "body_format_override": _error_body(error_type)}
        for status, error_type in ERROR_TYPES.items()
    ]
    mappers.append(
        {"filter": _status_is("GE", 500), "body_format_override": _error_body("InternalServerError")}
    )
    return {"mappers": mappers, "body_format": _error_body("BadRequestError")}


def _path_match(api_paths: Sequence[str]) -> dict[str, Any]:
    """Exactly these paths (Envoy drops the query string before matching)."""
    alternatives = "|".join(re.escape(p) for p in api_paths)
    return {"safe_regex": {"regex": f"({alternatives})"}}


def _by_method(api_paths: Sequence[str]) -> dict[str, list[str]]:
    """The API paths grouped by the one method each takes (``GET_PATHS``: GET, the rest POST)."""
    groups: dict[str, list[str]] = {}
    for path in api_paths:
        groups.setdefault("GET" if path in GET_PATHS else "POST", []).append(path)
    return groups


def _to_model_servers() -> dict[str, Any]:
    return {
        "cluster": MODEL_SERVERS_CLUSTER,
        "timeout": "0s",
        "idle_timeout": "600s",
        "retry_policy": {
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": RETRIES,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": _PREVIOUS_HOSTS},
                }
            ],
            "host_selection_retry_max_attempts": 5,
        },
    }


def _after_the_body(route: dict[str, Any]) -> dict[str, Any]:
    """``route``, answered only once the request's body is in: over HTTP/2 Envoy follows an answer
    that comes before the request's end with a stream reset, and some clients (curl 7.88) then
    drop the answer."""
    return {**route, "typed_per_filter_config": {_BUFFER_FILTER: {"@type": _FILTER_CONFIG, "config": {}}}}


def _method_routes(
    method: str, paths: Sequence[str], with_epp: bool, fail_open: bool, epp_filter: str
) -> list[dict[str, Any]]:
    """``paths`` with ``method``: to the EPP's pick (or round-robin when failing open, else a 503);
    with any other method, a 405 that names the one they take, as the engines answer."""
    api = {**_path_match(paths), "headers": [{"name": ":method", "string_match": {"exact": method}}]}
    routes: list[dict[str, Any]] = []
    if with_epp:
        picked = {"name": DESTINATION_HEADER, "present_match": True}
        routes.append({"match": {**api, "headers": [*api["headers"], picked]}, "route": _to_model_servers()})
    if fail_open:
        routes.append({"match": api, "route": _to_model_servers()})
    else:
        no_pick = {"status": 503, "body": {"inline_string": "no endpoint was picked"}}
        routes.append({"match": api, "direct_response": no_pick})
    if with_epp:
        # Turns on the EPP's filter the listener has off (an empty config: no override).
        enabled = {"@type": _FILTER_CONFIG, "config": {}}
        for route in routes:
            route["typed_per_filter_config"] = {epp_filter: enabled}
    wrong_method = _after_the_body(
        {
            "match": _path_match(paths),
            "direct_response": {
                "status": 405,
                "body": {"inline_string": f"method not allowed: {', '.join(paths)} take {method} only"},
            },
            "response_headers_to_add": [{"header": {"key": "allow", "value": method}}],
        }
    )
    return [*routes, wrong_method]


def _routes(
    api_paths: Sequence[str], with_epp: bool, fail_open: bool, epp_filter: str
) -> list[dict[str, Any]]:
    routes = [
        route
        for method, paths in _by_method(api_paths).items()
        for route in _method_routes(method, paths, with_epp, fail_open, epp_filter)
    ]
    served = ", ".join(api_paths)
    not_found = {
        "match": {"prefix": "/"},
        "direct_response": {
            "status": 404,
            "body": {"inline_string": f"not an inference API path; this gateway serves {served}"},
        },
    }
    routes.append(_after_the_body(not_found))
    return routes


def gateway_bootstrap(
    *,
    listen_port: int,
    epp_address: tuple[str, int] | None,
    endpoints_file: Path,
    failure_mode: FailureMode = "FailClose",
    body_mode: BodyMode = "BUFFERED",
    api_paths: Sequence[str] = INFERENCE_API_PATHS,
    listen_address: str = "127.0.0.1",
    max_request_bytes: int = 16 << 20,
    epp_tls: EppTls | None = None,
    access_log_to_epp: bool = False,
    ext_authz_port: int | None = None,
) -> dict[str, Any]:
    """An Envoy v3 bootstrap (as a dict, dump it to YAML or JSON) for the gateway; add ``admin`` to taste.

    ``endpoints_file`` holds the model servers (see :func:`write_cluster_endpoints`); it must
    exist when Envoy starts. ``api_paths`` are the request paths routed to them.
    ``access_log_to_epp``: log every routed request to the EPP (see the module doc).
    ``ext_authz_port``: ask the EPP over HTTP ext_authz on this port of its address instead of
    over ext_proc (``epp.extauthz.check``); the access log then finishes every request.
    """
    if not api_paths or not all(p.startswith("/") for p in api_paths):
        raise ValueError(f"api_paths must be non-empty absolute paths, got {list(api_paths)}")
    authz = ext_authz_port is not None
    if authz and (epp_address is None or epp_tls is not None or body_mode != "BUFFERED"):
        raise ValueError("the ext_authz callout needs an EPP address, no TLS and BUFFERED bodies")
    access_log_to_epp = access_log_to_epp or authz
    with_epp = epp_address is not None
    fail_open = failure_mode == "FailOpen" or not with_epp
    hcm = {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "max_request_headers_kb": CODEC_MAX_HEADERS_KB,
        "common_http_protocol_options": {"max_headers_count": CODEC_MAX_HEADERS},
        # One HTTP/2 header field may fill the whole limit (Envoy's default refuses one over
        # 64 KiB by closing the connection, whatever max_request_headers_kb says).
        "http2_protocol_options": {"max_header_field_size_kb": CODEC_MAX_HEADERS_KB},
        # HTTP/1.0 clients (ApacheBench, some health checkers) are served, not sent a 426.
        "http_protocol_options": {"accept_http_10": True, "default_host_for_http_10": "gateway"},
        # The client sees the request id the request was served under (the EPP's, if it replaced one).
        "always_set_request_id_in_response": True,
        **(
            {
                "access_log": [epp_access_log("epp")],
                "access_log_options": {"access_log_flush_interval": ACCESS_LOG_PERIOD},
            }
            if with_epp and access_log_to_epp
            else {}
        ),
        "local_reply_config": local_reply_config(),
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": _routes(
                        api_paths, with_epp, fail_open, _EXT_AUTHZ_FILTER if authz else _EXT_PROC_FILTER
                    ),
                }
            ]
        },
        "http_filters": [
            *([sse_marks_filter()] if with_epp and access_log_to_epp else []),
            {
                "name": "envoy.filters.http.header_mutation",
                "typed_config": {
                    "@type": _HEADER_MUTATION,
                    # The EPP's to set: a client's would pick its own upstream, or (the replica's
                    # id) send its request's log entry to another EPP replica.
                    "mutations": {
                        "request_mutations": [{"remove": DESTINATION_HEADER}, {"remove": REPLICA_HEADER}]
                    },
                },
            },
            # Enabled by the API routes only: a request with no route, as one Envoy's codec refuses
            # (headers over the limit), is answered without waiting on the EPP (Envoy resets
            # such a request instead when ext_proc must see its reply: envoyproxy/envoy#29440).
            *(
                [{**_epp_filter(failure_mode, body_mode, max_request_bytes, authz), "disabled": True}]
                if with_epp
                else []
            ),
            # Enabled by the routes Envoy answers itself (see _after_the_body).
            {
                "name": _BUFFER_FILTER,
                "typed_config": {"@type": _BUFFER, "max_request_bytes": max_request_bytes},
                "disabled": True,
            },
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    clusters = [model_servers_cluster(endpoints_file, picks_in_header=authz)]
    if epp_address is not None:
        clusters.append(_epp_cluster(epp_address, epp_tls))
    if epp_address is not None and ext_authz_port is not None:
        clusters.append(_ext_authz_cluster(epp_address[0], ext_authz_port))
    return {
        # xDS (the endpoints file) needs a node identity.
        "node": {"id": "gateway", "cluster": "gateway"},
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


_SSE_LUA = """
function envoy_on_response(handle)
  local content_type = handle:headers():get("content-type") or ""
  if string.find(content_type, "text/event-stream", 1, true) == nil then
    return
  end
  local tail = nil
  local events = 0
  for chunk in handle:bodyChunks() do
    if tail == nil then
      local at = handle:timestampString(EnvoyTimestampResolution.MICROSECOND)
      handle:streamInfo():dynamicMetadata():set("{ns}", "{first}", at)
      tail = ""
    end
    local text = tail .. chunk:getBytes(0, chunk:length())
    -- The tail is shorter than what is counted: no event is counted twice.
    local _, n = string.gsub(string.sub(text, math.max(1, string.len(tail) - 5)), "data: {{", "")
    events = events + n
    if string.find(text, "data: [DONE]", 1, true) ~= nil then
      handle:streamInfo():dynamicMetadata():set("{ns}", "{done}", true)
      break
    end
    tail = string.sub(text, -11)
  end
  -- Each call anew: Envoy's objects do not outlive a yield (each chunk is one).
  handle:streamInfo():dynamicMetadata():set("{ns}", "{events}", events)
end
""".format(
    ns=SSE_DONE_METADATA[0],
    done=SSE_DONE_METADATA[1],
    first=FIRST_BODY_BYTE_METADATA[1],
    events=SSE_EVENTS_METADATA[1],
)


def sse_marks_filter() -> dict[str, Any]:
    """The Lua filter that marks a streamed answer's first body chunk and its ``data: [DONE]``
    (see the module doc); it reads each chunk as it goes by and holds none back."""
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": _SSE_LUA}},
    }


def epp_access_log(cluster: str, replica_id: str | None = None) -> dict[str, Any]:
    """The access logger that sends the EPP (``cluster``) an entry for every request it routed
    (those that carry its destination header), batched (see the module doc); with ``replica_id``
    only those that replica routed (``epp.sync.replica_header``)."""
    config = {
        "@type": _HTTP_GRPC_LOG,
        "common_config": {
            "log_name": "llm-epp",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
            "transport_api_version": "V3",
            "buffer_flush_interval": ACCESS_LOG_FLUSH,
            "buffer_size_bytes": 16384,
        },
        "additional_request_headers_to_log": [REQUEST_ID_HEADER],
    }
    routed = {"header_filter": {"header": {"name": DESTINATION_HEADER, "present_match": True}}}
    if replica_id is not None:
        own = {"header_filter": {"header": {"name": REPLICA_HEADER, "string_match": {"exact": replica_id}}}}
        routed = {"and_filter": {"filters": [routed, own]}}
    return {"name": "envoy.access_loggers.http_grpc", "filter": routed, "typed_config": config}


def with_epp_replicas(
    bootstrap: dict[str, Any],
    replicas: Sequence[tuple[str, int, int]],
    ext_authz_ports: Sequence[int] = (),
    replica_ids: Sequence[str] = (),
) -> dict[str, Any]:
    """``bootstrap`` with its ext_proc cluster spread over active-active EPP replicas, each given as
    (address, ext_proc port, gRPC health port), and with the ext_authz callout its checks cluster
    too (each replica's ``ext_authz_ports``, in the same order). Each replica gets the access-log
    entries of the requests it routed, told by their ``replica_ids`` header (each replica's
    ``--replica-id``, in the same order), or without them every entry.

    Envoy health-checks every replica over gRPC on its health port (the ext_proc service's
    readiness, every 0.5 s, down after 2 failures) and ejects one whose streams fail (outlier
    detection: 2 local-origin failures, such as refused connections, or 3 gateway errors), so a
    dead or stopping replica gets no new streams within about a second. New streams are spread
    round-robin; the replicas keep one view of the load through ``epp.sync``. With TLS to the
    EPPs the health checks stay plaintext, as the health port is."""
    clusters = bootstrap["static_resources"]["clusters"]
    authz = any(c["name"] == EXT_AUTHZ_CLUSTER for c in clusters)
    if authz and len(ext_authz_ports) != len(replicas):
        raise ValueError("the ext_authz callout needs each replica's ext_authz port")
    [epp] = [c for c in clusters if c["name"] == "epp"]
    epp = _spread(epp, replicas)
    if authz:
        checks = _spread(
            next(c for c in clusters if c["name"] == EXT_AUTHZ_CLUSTER),
            [(a, port, None) for (a, _, _), port in zip(replicas, ext_authz_ports, strict=True)],
            ready_path=READY_PATH,
        )
        clusters = [checks if c["name"] == EXT_AUTHZ_CLUSTER else c for c in clusters]
    clusters = [epp if c["name"] == "epp" else c for c in clusters]
    listeners = bootstrap["static_resources"]["listeners"]
    hcm = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
    if "access_log" in hcm:  # a logger per replica
        log_clusters = [
            {
                **{k: v for k, v in epp.items() if k not in ("health_checks", "outlier_detection")},
                "name": f"epp-log-{i}",
                "load_assignment": _load_assignment(f"epp-log-{i}", [(a, p)]),
            }
            for i, (a, p, _) in enumerate(replicas)
        ]
        clusters += log_clusters
        ids: Sequence[str | None] = replica_ids or [None] * len(log_clusters)
        loggers = [epp_access_log(c["name"], i) for c, i in zip(log_clusters, ids, strict=True)]
        hcm = {**hcm, "access_log": loggers}
        chain = {
            **listeners[0]["filter_chains"][0],
            "filters": [{**listeners[0]["filter_chains"][0]["filters"][0], "typed_config": hcm}],
        }
        listeners = [{**listeners[0], "filter_chains": [chain]}, *listeners[1:]]
    resources = {**bootstrap["static_resources"], "clusters": clusters, "listeners": listeners}
    return {**bootstrap, "static_resources": resources}
