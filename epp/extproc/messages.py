"""Builders for the ext_proc messages the EPP sends back to Envoy (upb-backed xds-protos types)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct, Value

from epp.errors import RequestError

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_BY_HEADER = "x-llm-epp-served-by"
"""Added by this project's Envoy config to the upstream's response headers: the ``ip:port`` that
answered (after any retries), for the EPP to see; the EPP removes it from the response."""
SERVED_METADATA_KEY = "x-gateway-destination-endpoint-served"
"""Where a gateway that follows the endpoint picker protocol reports the ``ip:port`` that
answered: in the ``envoy.lb`` namespace of the response's metadata."""
LB_METADATA_NAMESPACE = "envoy.lb"
# Envoy recommends body chunks of at most 64 KiB; the anchor re-chunks at 62,000 bytes.
BODY_CHUNK_BYTES = 62_000

SKIP_RESPONSE_BODY = ProcessingMode(response_body_mode=ProcessingMode.NONE)
CONTINUE_REQUEST_HEADERS = ProcessingResponse(request_headers=HeadersResponse())
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
CONTINUE_RESPONSE_HEADERS = ProcessingResponse(response_headers=HeadersResponse())
CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=BodyResponse())
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


def served_endpoint(message: ProcessingRequest, headers: Mapping[str, str]) -> str | None:
    """The ``ip:port`` that answered this response, as the gateway reports it (protocol
    metadata first, then this project's header), or None if it does not."""
    lb = message.metadata_context.filter_metadata.get(LB_METADATA_NAMESPACE)
    if lb is not None and SERVED_METADATA_KEY in lb.fields:
        value = lb.fields[SERVED_METADATA_KEY]
        if value.HasField("string_value") and value.string_value:
            return value.string_value
    return headers.get(SERVED_BY_HEADER)


def header_dict(headers: HeaderMap) -> dict[str, str]:
    """Envoy's header map as ``{lowercase name: value}``; repeated names are comma-joined."""
    result: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        result[key] = f"{result[key]},{value}" if key in result else value
    return result


def _set_headers(headers: Mapping[str, str]) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode()),
                append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in headers.items()
        ]
    )


def route_to(
    targets: Iterable[str],
    extra_headers: Mapping[str, str],
    *,
    in_body_reply: bool = False,
    skip_response_body: bool = False,
) -> ProcessingResponse:
    """The reply that sends the request to ``targets[0]``.

    The destination goes both in the header Envoy's original-destination cluster reads and
    in ``envoy.lb`` dynamic metadata (comma-separated, fallbacks after the first), and the
    route cache is cleared so the new header takes effect. It answers the request headers,
    or, when Envoy buffers the body (``in_body_reply``), the request body: request headers
    are still mutable then. ``skip_response_body`` tells Envoy not to send this request's
    response body (a ``mode_override``; the filter must allow overrides).
    """
    targets = list(targets)
    headers = {DESTINATION_HEADER: targets[0], **extra_headers}
    destination = Struct(fields={DESTINATION_HEADER: Value(string_value=",".join(targets))})
    metadata = Struct(fields={LB_METADATA_NAMESPACE: Value(struct_value=destination)})
    common = CommonResponse(header_mutation=_set_headers(headers), clear_route_cache=True)
    reply = ProcessingResponse(dynamic_metadata=metadata)
    if in_body_reply:
        reply.request_body.response.CopyFrom(common)
    else:
        reply.request_headers.response.CopyFrom(common)
    if skip_response_body:
        reply.mode_override.CopyFrom(SKIP_RESPONSE_BODY)
    return reply


def add_response_headers(headers: Mapping[str, str], remove: Sequence[str] = ()) -> ProcessingResponse:
    """Response-headers reply that adds ``headers`` to the response and removes the headers
    named in ``remove`` (continue otherwise)."""
    if not headers and not remove:
        return CONTINUE_RESPONSE_HEADERS
    mutation = _set_headers(headers)
    mutation.remove_headers.extend(remove)
    common = CommonResponse(header_mutation=mutation)
    return ProcessingResponse(response_headers=HeadersResponse(response=common))


def streamed_request_body(body: bytes) -> list[ProcessingResponse]:
    """Re-emit a buffered request body in chunks (full-duplex streamed mode), last one marked."""
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    last = len(chunks) - 1
    return [
        ProcessingResponse(
            request_body=BodyResponse(
                response=CommonResponse(
                    body_mutation=BodyMutation(
                        streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=i == last)
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


def immediate(error: RequestError) -> ProcessingResponse:
    """Answer the client directly with the error's status, headers and JSON body."""
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=error.status),
            headers=_set_headers(error.headers()),
            body=error.body(),
            details=error.dropped_reason or error.error_type,
        )
    )


def extend_timeout(seconds: float) -> ProcessingResponse:
    """The reply that tells Envoy to wait ``seconds`` (from now) for the answer to the message in
    flight; Envoy honours one per message, up to the filter's ``max_message_timeout``."""
    whole = int(seconds)
    return ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )
