"""The ext_proc gRPC service over a real gRPC connection: when it ends a stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from epp.extproc.server import ExternalProcessor, add_to_server
from tests.epp.extproc_harness import (
    Harness,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    routed_destination,
)

# Long enough for a loaded machine; a stream the server does not end never answers at all.
ANSWER_S = 10.0


@pytest.fixture
async def served() -> AsyncIterator[tuple[Harness, ext_proc_grpc.ExternalProcessorStub]]:
    harness = Harness()
    server = grpc.aio.server()
    add_to_server(ExternalProcessor(harness.director, harness.max_body, harness.gate), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield harness, ext_proc_grpc.ExternalProcessorStub(channel)
    finally:
        await server.stop(None)


def _body(stream: bool) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "stream": stream}).encode()


async def test_a_finished_request_ends_its_stream_without_waiting_for_envoy_to_close(served) -> None:
    harness, stub = served
    call = stub.Process()
    await call.write(headers_msg(buffered=True))
    await call.read()
    await call.write(body_msg(_body(stream=False), eos=True))
    assert routed_destination(await call.read()).startswith("10.0.0.1:")
    await call.write(response_headers_msg(200, "application/json", eos=False))
    assert (await call.read()).HasField("response_headers")
    # No done_writing(): the server ends the stream itself, with OK, and settles the books.
    assert await asyncio.wait_for(call.code(), ANSWER_S) == grpc.StatusCode.OK
    assert harness.in_flight() == 0


async def test_a_refused_request_ends_its_stream_with_the_error_reply(served) -> None:
    _, stub = served
    call = stub.Process()
    await call.write(headers_msg(buffered=True))
    await call.read()
    await call.write(body_msg(b"{not json", eos=True))
    assert (await call.read()).immediate_response.status.code == 400
    assert await asyncio.wait_for(call.code(), ANSWER_S) == grpc.StatusCode.OK


async def test_a_streamed_response_keeps_its_stream_until_the_last_chunk(served) -> None:
    harness, stub = served
    call = stub.Process()
    await call.write(headers_msg(buffered=True))
    await call.read()
    await call.write(body_msg(_body(stream=True), eos=True))
    await call.read()
    await call.write(response_headers_msg(200, "text/event-stream", eos=False))
    await call.read()
    chunk = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
    await call.write(response_body_msg(chunk, eos=False))
    assert (await call.read()).HasField("response_body")  # still open: the chunk was answered
    assert harness.in_flight() == 1
    await call.write(response_body_msg(b"data: [DONE]\n\n", eos=True))
    assert (await call.read()).HasField("response_body")
    assert await asyncio.wait_for(call.code(), ANSWER_S) == grpc.StatusCode.OK
    assert harness.in_flight() == 0
