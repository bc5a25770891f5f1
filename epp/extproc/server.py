"""The gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from epp.extproc.gate import DEFAULT_GATE, RequestGate
from epp.extproc.stream import ExtProcStream
from epp.requestcontrol.director import Director

log = logging.getLogger(__name__)


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, max_body_bytes: int, gate: RequestGate = DEFAULT_GATE) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.gate = gate

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = ExtProcStream(self.director, self.max_body_bytes, self.gate)
        try:
            async for message in request_iterator:
                if stream.may_wait(message):
                    async for reply in _replies_while_held(stream, message):
                        yield reply
                else:
                    for reply in await stream.on_message(message):
                        yield reply
                if stream.done:
                    # Nothing more to do for this request: end the stream now (Envoy carries on
                    # without the processor) instead of waiting for Envoy to close its side,
                    # which saves gRPC a receive and a wake-up of this loop per request.
                    return
        except Exception:
            # A bug, not bad input: end the stream with an error and let Envoy's failure
            # mode (fail-open or fail-closed) decide what the client sees.
            log.exception("ext_proc stream failed")
            await context.abort(grpc.StatusCode.INTERNAL, "endpoint picker error")
        finally:
            stream.close()


async def _replies_while_held(
    stream: ExtProcStream, message: ProcessingRequest
) -> AsyncIterator[ProcessingResponse]:
    """``stream``'s replies to ``message``, after those it sends while flow control holds the
    request (the extension of Envoy's message timeout), each as soon as it is made."""
    interim: asyncio.Queue[ProcessingResponse] = asyncio.Queue()
    stream.on_interim = interim.put_nowait
    answer = asyncio.ensure_future(stream.on_message(message))
    next_interim: asyncio.Future[ProcessingResponse] | None = None
    try:
        while not answer.done():
            next_interim = asyncio.ensure_future(interim.get())
            await asyncio.wait((answer, next_interim), return_when=asyncio.FIRST_COMPLETED)
            if next_interim.done():
                yield next_interim.result()
            else:
                next_interim.cancel()
        while not interim.empty():
            yield interim.get_nowait()
        for reply in answer.result():
            yield reply
    finally:
        stream.on_interim = None
        answer.cancel()  # the stream went away while the request waited: it leaves the queue
        if next_interim is not None:
            next_interim.cancel()


def add_to_server(service: ExternalProcessor, server: grpc.aio.Server) -> None:
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(service, server)
