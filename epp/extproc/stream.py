"""The per-stream state machine: one ext_proc gRPC stream carries one HTTP request.

Envoy (see ``sim.envoy_config``) sends request headers, the request body, response headers
and a STREAMED response body. The machine's phases::

    HEADERS ──(end_of_stream)──────────────────────────► route now (body-less request)
       │ body follows
       ▼
    BODY ── collect chunks (413 past the limit) ── end of body ──► parse + schedule ──► route
       ▼
    RESPONSE ── headers: status, content type ── body chunks: meter tokens, reply at once,
                until the body ends, or (first-token metering) until the first token

Envoy sends a body only after the reply to its headers (``sim.envoy_config`` turns
``send_body_without_waiting_for_header_response`` off), which is what lets the response headers
reply skip the body of a non-streamed response: such a request costs three messages each way
(request headers, request body, response headers); a streamed one costs one more each way per
response chunk, and one for the body's end. With first-token metering
(``epp.requestcontrol.completion_log``) a streamed one ends at its first token, a non-streamed
one with a BUFFERED body at its routing (two messages each way), and the gateway's access log
finishes them. With first-token metering the reply to the request headers also asks Envoy for
no response headers (a ``mode_override``) unless the caller wants a decision trace: the status
and the endpoint that answered come as response attributes with the first body chunk, so a
streamed request costs three messages each way (headers, body, first token). The request's
books (bookings, observers, metrics) are settled in :meth:`ExtProcStream.close`, after the last
reply has gone: off Envoy's path, which takes ~30 µs off the answer to a non-streamed
response's headers.

The request body arrives in one of two modes, announced by Envoy's ``protocol_config``:

* BUFFERED (the local gateway's, ``sim.envoy_config``): the headers are answered at once, the
  body comes whole in one message after that, and the body reply carries the destination.
* FULL_DUPLEX_STREAMED (the anchor's gateways): nothing is answered until the body ends; then
  the headers reply carries the destination and content-length, and the body is re-emitted.

Before anything else the request's headers pass the gate (``epp.extproc.gate``): headers that
would leave no room for the EPP's own get a 431, and ``x-llm-epp-debug`` is dropped unless the
caller may see decision traces. Errors while the request is still ours become an immediate
response (400/413/429/431/503 with a JSON body). An unexpected exception (a bug) is one log
line and, while the request is still ours, a JSON 500; later, the request goes on unmetered.
Either way the stream carries on: the state machine never raises into the gRPC layer.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from epp.errors import InternalServerError, PayloadTooLarge, RequestError
from epp.extproc import messages
from epp.extproc.envoy_contract import MAX_MESSAGE_TIMEOUT_S, MESSAGE_TIMEOUT_S
from epp.extproc.gate import DEFAULT_GATE, RequestGate
from epp.requestcontrol.director import REQUEST_ID_HEADER, Director
from epp.requestcontrol.events import Routed
from epp.requestcontrol.handle import RequestHandle
from epp.scheduling.types import SchedulingResult

log = logging.getLogger(__name__)


def routes(message: ProcessingRequest) -> bool:
    """Whether ``message`` may end the request body, so that its answer waits for the pick (and
    for flow control): answer it with :meth:`ExtProcStream.route`, any other with
    :meth:`ExtProcStream.answer`."""
    return message.HasField("request_body") or message.HasField("request_trailers")


class Phase(enum.Enum):
    HEADERS = "headers"
    BODY = "body"
    FORWARDED = "forwarded"
    RESPONSE = "response"
    DONE = "done"


class ExtProcStream:
    """Consumes Envoy's ProcessingRequests for one HTTP request and yields the replies."""

    def __init__(self, director: Director, max_body_bytes: int, gate: RequestGate = DEFAULT_GATE) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.gate = gate
        self.phase = Phase.HEADERS
        self.handle: RequestHandle | None = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._duplex = True
        self._watch_response_body = True
        self._refusal: RequestError | None = None

    async def on_message(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """All the replies to ``message`` at once (the server sends each as it is made)."""
        if routes(message):
            return [reply async for reply in self.route(message)]
        return self.answer(message)

    def answer(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """The replies to a message that never waits (any but those :func:`routes` names).
        Never raises (see the module doc)."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._request_headers(message)
            if kind == "response_headers":
                return self._response_headers(message)
            if kind == "response_body":
                return self._response_body(message)
            if kind == "response_trailers":
                self.phase = Phase.DONE
                return [messages.CONTINUE_RESPONSE_TRAILERS]
        except Exception as exc:
            return self._internal_error(message, exc)
        log.debug("ignoring ext_proc message of kind %s", kind)
        return []

    async def route(self, message: ProcessingRequest) -> AsyncIterator[ProcessingResponse]:
        """The replies to a request body chunk or the request's trailers, each as soon as it is
        made: when they end the body, the request is routed, and while flow control holds a
        BUFFERED body's request the extension of Envoy's message timeout comes first (Envoy
        times no message of a FULL_DUPLEX_STREAMED one). Never raises (see the module doc)."""
        trailers = message.HasField("request_trailers")
        try:
            if trailers:  # they end a body whose last chunk did not carry end_of_stream
                replies = None if self.phase is Phase.BODY else []
            else:
                replies = self._request_body(message.request_body.body, message.request_body.end_of_stream)
            if replies is None and self._refusal is not None:  # the body is whole: refuse it
                replies = [self._reject(self._refusal)]
            if replies is None:  # the body is whole: route it
                handle = self.handle
                assert handle is not None
                body = b"".join(self._body)
                self._body.clear()
                path = self._headers.get(":path", "/")
                try:
                    async for event in handle.schedule(path, self._headers, body):
                        if isinstance(event, Routed):
                            replies = self._forward(handle, event.result, body)
                        elif not self._duplex:  # held: Envoy is to wait (and a little for the pick)
                            yield messages.extend_timeout(
                                min(event.max_wait_s + MESSAGE_TIMEOUT_S, MAX_MESSAGE_TIMEOUT_S)
                            )
                except RequestError as error:
                    replies = [self._reject(error)]
                assert replies is not None
            if trailers and self.phase is not Phase.DONE:
                replies.append(messages.CONTINUE_REQUEST_TRAILERS)
        except Exception as exc:
            replies = self._internal_error(message, exc)
        for reply in replies:
            yield reply

    @property
    def done(self) -> bool:
        """Whether the request needs nothing more from this stream (answered, or finished)."""
        return self.phase is Phase.DONE

    def close(self) -> None:
        """The gRPC stream ended (request done, client gone, or Envoy reset): settle the books.
        A complete response only makes the stream :attr:`done`; the server calls this after
        the last reply has gone, so settling (observers, metrics) is off the response's path."""
        if self.handle is not None:
            self.handle.finish()
        self.phase = Phase.DONE

    def _request_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers = messages.header_dict(message.request_headers.headers)
        self._headers = self.gate.debug.filter(headers, messages.source_address(message))
        self.handle = self.director.open(self._headers)
        if message.HasField("protocol_config"):
            mode = message.protocol_config.request_body_mode
            self._duplex = mode == ProcessingMode.FULL_DUPLEX_STREAMED
        try:
            self.gate.limits.check(message.request_headers.headers)
        except RequestError as error:
            if message.request_headers.end_of_stream:
                return [self._reject(error)]
            # Answered once the body is in: over HTTP/2 Envoy follows an answer that comes before
            # the request's end with a stream reset, and some clients (curl 7.88) drop the answer.
            self._refusal = error
        if not message.request_headers.end_of_stream:
            self.phase = Phase.BODY
            if self._duplex:
                return []
            if self.director.skips_response_headers(self._headers):
                return [messages.CONTINUE_SKIPPING_RESPONSE_HEADERS]
            return [messages.CONTINUE_REQUEST_HEADERS]
        try:
            result = self.handle.schedule_bodyless()
        except RequestError as error:
            return [self._reject(error)]
        self.phase = Phase.FORWARDED
        self._watch_response_body = False
        extra = {REQUEST_ID_HEADER: self.handle.request_id}
        return [messages.route_to([t.hostport for t in result.targets], extra, skip_response_body=True)]

    def _request_body(self, chunk: bytes, end_of_stream: bool) -> list[ProcessingResponse] | None:
        """The replies to a chunk of the request body; None when the body is whole (route it)."""
        if self.phase is not Phase.BODY:
            return []
        self._body_size += len(chunk)
        if self._body_size > self.max_body_bytes:
            return [
                self._reject(
                    PayloadTooLarge(f"request body exceeds the limit of {self.max_body_bytes} bytes")
                )
            ]
        self._body.append(chunk)
        # A BUFFERED body comes whole in one message (end_of_stream is false when trailers follow).
        return None if end_of_stream or not self._duplex else []

    def _forward(
        self, handle: RequestHandle, result: SchedulingResult, body: bytes
    ) -> list[ProcessingResponse]:
        """The replies that send the routed request on to ``result``'s endpoints."""
        self.phase = Phase.FORWARDED
        targets = [t.hostport for t in result.targets]
        # Only streamed responses are metered token by token; for the others the response
        # headers carry all the EPP needs (status, completion time), so the headers reply
        # skips their body.
        self._watch_response_body = handle.request is not None and handle.request.stream
        upstream = handle.upstream_headers()
        if not self._duplex:
            extra = {REQUEST_ID_HEADER: handle.request_id, **upstream}
            if handle.hand_off_unread():
                self.phase = Phase.DONE  # the access log finishes it; Envoy goes on without us
            return [messages.route_to(targets, extra, in_body_reply=True)]
        extra = {"content-length": str(len(body)), REQUEST_ID_HEADER: handle.request_id, **upstream}
        return [messages.route_to(targets, extra), *messages.streamed_request_body(body)]

    def _response_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        handle = self.handle
        if handle is None or self.phase is not Phase.FORWARDED:
            return [messages.CONTINUE_RESPONSE_HEADERS]
        status, content_type = messages.status_and_content_type(message.response_headers.headers)
        body_comes = not message.response_headers.end_of_stream
        body_follows = self._watch_response_body and body_comes
        served_by = messages.served_endpoint(message)
        handle.response_headers(status, content_type, body_follows, served_by)
        skip_body = body_comes and not body_follows
        reply = messages.add_response_headers(handle.debug_headers(), skip_body=skip_body)
        self.phase = Phase.RESPONSE if body_follows else Phase.DONE
        return [reply]

    def _headerless_response(self, message: ProcessingRequest) -> None:
        """The response's first body chunk came without its headers (the EPP asked for none):
        its status and the endpoint that answered come as Envoy's response attributes. Without
        a status attribute, an SSE event says 200 and anything else nothing (0): the access log
        has the status either way."""
        handle = self.handle
        assert handle is not None and handle.request is not None
        chunk = message.response_body.body
        status = messages.response_status(message)
        if status is None:
            status = 200 if chunk.startswith(b"data:") else 0
        sse = handle.request.stream and 200 <= status < 300
        served_by = messages.served_endpoint(message)
        handle.response_headers(
            status, "text/event-stream" if sse else "", self._watch_response_body, served_by
        )
        self.phase = Phase.RESPONSE if self._watch_response_body else Phase.DONE

    def _response_body(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        if self.phase is Phase.FORWARDED and self.handle is not None and self.handle.request is not None:
            self._headerless_response(message)
        chunk, end_of_stream = message.response_body.body, message.response_body.end_of_stream
        handle = self.handle
        # Ending the stream at the body's end, or at a handed-off response's first token, lets
        # Envoy re-inject the chunks it queued and go on without the EPP.
        if handle is not None and self.phase is Phase.RESPONSE and handle.response_body(chunk, end_of_stream):
            self.phase = Phase.DONE
        return [messages.CONTINUE_RESPONSE_BODY]

    def _reject(self, error: RequestError) -> ProcessingResponse:
        if self.handle is not None:
            self.handle.reject(error)
        self.phase = Phase.DONE
        return messages.immediate(error)

    def _internal_error(self, message: ProcessingRequest, exc: Exception) -> list[ProcessingResponse]:
        error = InternalServerError(exc)
        ours = self.phase in (Phase.HEADERS, Phase.BODY)
        if self.handle is None or not ours:  # else the handle's rejection logs it
            request_id = self.handle.request_id if self.handle else "-"
            log.error("request %s (%s phase): %s", request_id, self.phase.value, error.log_message())
        if ours:
            return [self._reject(error)]
        # The request is on its way upstream already: let it be; close() settles the books.
        self.phase = Phase.DONE
        continuation = messages.CONTINUE_BY_KIND.get(message.WhichOneof("request") or "")
        return [continuation] if continuation else []
