"""The gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from epp.extproc.stream import ExtProcStream
from epp.requestcontrol.director import Director

log = logging.getLogger(__name__)


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, max_body_bytes: int) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = ExtProcStream(self.director, self.max_body_bytes)
        try:
            async for message in request_iterator:
                for reply in await stream.on_message(message):
                    yield reply
        except Exception:
            # A bug, not bad input: end the stream with an error and let Envoy's failure
            # mode (fail-open or fail-closed) decide what the client sees.
            log.exception("ext_proc stream failed")
            await context.abort(grpc.StatusCode.INTERNAL, "endpoint picker error")
        finally:
            stream.close()


def add_to_server(service: ExternalProcessor, server: grpc.aio.Server) -> None:
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(service, server)
