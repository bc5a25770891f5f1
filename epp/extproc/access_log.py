"""The gRPC access-log service (``envoy.service.accesslog.v3.AccessLogService``) the gateway
sends its HTTP access log to, batched (``sim.envoy_config``: ``envoy.access_loggers.http_grpc``).

Each entry becomes a :class:`~epp.requestcontrol.completion_log.LogEntry` for the director,
which finishes the requests it handed off (streams at their first token, non-streamed answers
at their routing). Envoy keeps one
stream open per worker thread and sends each batch as one message.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.data.accesslog.v3.accesslog_pb2 import AccessLogCommon, AccessLogType, HTTPAccessLogEntry
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage, StreamAccessLogsResponse
from google.protobuf.struct_pb2 import Value

from epp.extproc.envoy_contract import FIRST_BODY_BYTE_METADATA, SSE_DONE_METADATA, SSE_EVENTS_METADATA
from epp.requestcontrol.completion_log import Ending, LogEntry
from epp.requestcontrol.director import REQUEST_ID_HEADER

log = logging.getLogger(__name__)
_PERIODIC = frozenset((AccessLogType.DownstreamPeriodic, AccessLogType.UpstreamPeriodic))


def _mark(entry: HTTPAccessLogEntry, where: tuple[str, str]) -> Value | None:
    """The gateway's mark ``where`` (namespace, key) in the entry's dynamic metadata, if set."""
    namespace, key = where
    marks = entry.common_properties.metadata.filter_metadata.get(namespace)
    return marks.fields[key] if marks is not None and key in marks.fields else None


def _sse_done(entry: HTTPAccessLogEntry) -> bool:
    mark = _mark(entry, SSE_DONE_METADATA)
    return mark is not None and mark.bool_value


def _first_body_byte_s(entry: HTTPAccessLogEntry) -> float | None:
    """When the answer's first body chunk passed the gateway, from the request's start."""
    mark = _mark(entry, FIRST_BODY_BYTE_METADATA)
    if mark is None or not (mark.string_value.isascii() and mark.string_value.isdigit()):
        return None
    start = entry.common_properties.start_time
    return max(0.0, (int(mark.string_value) - start.seconds * 1_000_000 - start.nanos // 1000) / 1e6)


def _sse_events(entry: HTTPAccessLogEntry) -> int | None:
    mark = _mark(entry, SSE_EVENTS_METADATA)
    return None if mark is None else int(mark.number_value)


def _ending(entry: HTTPAccessLogEntry) -> Ending:
    flags = entry.common_properties.response_flags
    if flags.downstream_connection_termination or flags.downstream_remote_reset:
        # A client that hangs up on `data: [DONE]` (the openai SDK does) got the whole answer.
        return "complete" if _sse_done(entry) else "client_gone"
    if (
        flags.upstream_remote_reset
        or flags.upstream_connection_termination
        or flags.upstream_connection_failure
        or flags.upstream_protocol_error
    ):
        return "upstream_reset"
    if flags.ListFields():
        return "failed"
    return "complete"


def _upstream_hostport(common: AccessLogCommon) -> str | None:
    """The ``ip:port`` that answered (after any retries), or None when no upstream did."""
    address = common.upstream_remote_address.socket_address
    return f"{address.address}:{address.port_value}" if address.address else None


def log_entry(entry: HTTPAccessLogEntry) -> LogEntry:
    """The parts of Envoy's entry the director reads. The request id is the request's
    ``x-request-id`` as forwarded (the EPP may have replaced the client's), logged through
    ``additional_request_headers_to_log``; Envoy's own field is the fallback."""
    common, request, response = entry.common_properties, entry.request, entry.response
    last = (
        common.time_to_last_upstream_rx_byte.ToNanoseconds() / 1e9
        if common.HasField("time_to_last_upstream_rx_byte")
        else None
    )
    return LogEntry(
        request_id=request.request_headers.get(REQUEST_ID_HEADER) or request.request_id,
        status=response.response_code.value,
        response_bytes=response.response_body_bytes,
        last_upstream_byte_s=last,
        ended=_ending(entry),
        served_by=_upstream_hostport(common),
        intermediate=common.intermediate_log_entry or common.access_log_type in _PERIODIC,
        sse_events=_sse_events(entry),
        first_body_byte_s=_first_body_byte_s(entry),
    )


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Hands every HTTP entry of every batch to ``sink`` (the director's ``log_entry``)."""

    def __init__(self, sink: Callable[[LogEntry], None]) -> None:
        self.sink = sink

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    self.sink(log_entry(entry))
                except Exception:  # a bug: lose this entry (its booking expires), keep the stream
                    log.exception("access-log entry failed")
        return StreamAccessLogsResponse()


def add_to_server(receiver: AccessLogReceiver, server: grpc.aio.Server) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
