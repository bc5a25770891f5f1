"""The gRPC floor: an ext_proc servicer that does nothing but answer, for ``llm-epp-bench stack``.

It speaks the same protocol as the EPP behind the local gateway's Envoy (request headers, a
BUFFERED body, response headers; the stream ends after the reply to those), with the same gRPC
server (``grpc.aio`` on uvloop, the EPP's options) and the same reply builders, but picks the
next replica in turn and reads nothing: no parse, no tokenizer, no scheduling, no metrics. What
it costs per request is what a Python ext_proc service on grpcio pays on this machine before it
does any work, the floor under the EPP's own figures.

    python -m bench.harness.grpc_floor --port PORT [--target HOST:PORT ...]

``bench.runs.inflight_cost`` drives it with response body chunks alone, for gRPC's cost per message.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from epp.app import GRPC_OPTIONS
from epp.extproc import messages
from epp.requestcontrol.director import REQUEST_ID_HEADER
from sim.envoy_config import gateway_bootstrap
from sim.processes import Component, free_port, port_in_use, spawn, start_envoy, wait_until


class FloorProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """Routes every request with a body to the next of ``targets``, skips response bodies, and
    continues everything else. Without targets it serves only messages that need no pick (what
    ``bench.runs.inflight_cost`` sends)."""

    def __init__(self, targets: Sequence[str]) -> None:
        self._targets: Iterator[str] | None = itertools.cycle(targets) if targets else None

    def reply(self, message: ProcessingRequest) -> tuple[ProcessingResponse, bool]:
        """The answer to ``message``, and whether the stream is done after it."""
        kind = message.WhichOneof("request")
        if kind == "request_body":
            if self._targets is None:
                raise ValueError("a request body came, and there is no target to route it to")
            extra = {REQUEST_ID_HEADER: "floor"}
            return messages.route_to([next(self._targets)], extra, in_body_reply=True), False
        if kind == "response_headers":
            return messages.add_response_headers({}, skip_body=True), True
        return messages.CONTINUE_BY_KIND[kind or ""], False

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        async for message in request_iterator:
            answer, done = self.reply(message)
            yield answer
            if done:
                return


@dataclass
class FloorGateway:
    servicer: Component
    envoy: Component
    url: str


@contextmanager
def floor_gateway(
    replica_ports: Sequence[int], endpoints_file: Path, workdir: Path
) -> Iterator[FloorGateway]:
    """The local gateway's Envoy config (``gateway_bootstrap``) over the replicas in
    ``endpoints_file``, with this servicer, in its own process, as the ext_proc service."""
    servicer_port, gateway_port = free_port(), free_port()
    targets = [arg for port in replica_ports for arg in ("--target", f"127.0.0.1:{port}")]
    argv = [sys.executable, "-m", "bench.harness.grpc_floor", "--port", str(servicer_port), *targets]
    servicer = spawn("grpc-floor", argv, workdir)
    envoy: Component | None = None
    try:
        wait_until(servicer, lambda: port_in_use(servicer_port))
        bootstrap = gateway_bootstrap(
            listen_port=gateway_port, epp_address=("127.0.0.1", servicer_port), endpoints_file=endpoints_file
        )
        envoy = start_envoy("gateway-grpc-floor", bootstrap, workdir)
        yield FloorGateway(servicer, envoy, f"http://127.0.0.1:{gateway_port}")
    finally:
        if envoy is not None:
            envoy.stop()
        servicer.stop()


async def serve(port: int, targets: Sequence[str]) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(targets), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", action="append", default=[], help="a replica's host:port")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.target))


if __name__ == "__main__":
    main()
