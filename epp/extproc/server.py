"""The gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from epp.extproc.gate import DEFAULT_GATE, RequestGate
from epp.extproc.stream import ExtProcStream, routes
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
                if routes(message):
                    async for reply in stream.route(message):
                        yield reply
                else:
                    for reply in stream.answer(message):
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


def add_to_server(service: ExternalProcessor, server: grpc.aio.Server) -> None:
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(service, server)
