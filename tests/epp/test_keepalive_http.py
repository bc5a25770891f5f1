"""The scraper's keep-alive GET client against a real socket server that answers as told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop

from epp.keepalive_http import HttpError, KeepAliveHttp


class Hangup(bytes):
    """An answer after which the server closes the connection."""


SILENT = b""
"""No answer: the server keeps the connection and says nothing."""
Answer = Callable[[bytes], bytes | None]
"""A request's bytes → the raw answer to write (None: hang up without one)."""


def ok(body: bytes, *extra: str) -> bytes:
    headers = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


class Server:
    """Counts connections and requests; each request is answered by ``answer``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while request := await reader.readuntil(b"\r\n\r\n"):
                self.requests.append(request)
                reply = self.answer(request)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if isinstance(reply, Hangup):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def drop_connections(self) -> None:
        for writer in self.writers:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], asyncio.Future]]:
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> tuple[Server, int]:
        state = Server(answer)
        server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
        servers.append(server)
        return state, server.sockets[0].getsockname()[1]

    yield start  # type: ignore[misc]
    for server in servers:
        server.close()


async def test_gets_reuse_one_connection_and_return_each_body(serve) -> None:
    server, port = await serve(lambda request: ok(request.split(b" ")[1]))
    client = KeepAliveHttp("127.0.0.1", port)
    assert [await client.get(p) for p in ("/metrics", "/v1/models", "/metrics")] == [
        b"/metrics",
        b"/v1/models",
        b"/metrics",
    ]
    assert server.connections == 1
    assert server.requests[0] == f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    client.close()


async def test_a_chunked_body_is_joined(serve) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    _, port = await serve(lambda request: chunked)
    client = KeepAliveHttp("127.0.0.1", port)
    assert await client.get("/metrics") == b"hello world"
    assert await client.get("/metrics") == b"hello world"


async def test_an_idle_connection_the_server_closed_is_replaced(serve) -> None:
    server, port = await serve(lambda request: ok(b"x"))
    client = KeepAliveHttp("127.0.0.1", port)
    assert await client.get("/metrics") == b"x"
    server.drop_connections()
    await asyncio.sleep(0.05)
    assert await client.get("/metrics") == b"x"
    assert server.connections == 2


async def test_connection_close_is_honoured(serve) -> None:
    server, port = await serve(lambda request: ok(b"x", "Connection: close"))
    client = KeepAliveHttp("127.0.0.1", port)
    for _ in range(3):
        assert await client.get("/metrics") == b"x"
    assert server.connections == 3


async def test_a_reused_connection_lost_before_the_answer_is_retried_once_on_a_new_one(serve) -> None:
    """The server closes the kept-alive connection as the next request arrives (its idle
    timeout racing the request): nothing of the answer came, so the request goes again."""
    answers = iter([ok(b"first"), None, ok(b"again")])
    server, port = await serve(lambda request: next(answers))
    client = KeepAliveHttp("127.0.0.1", port)
    assert await client.get("/metrics") == b"first"
    assert await client.get("/metrics") == b"again"
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_fresh_connection_lost_is_an_error_not_a_retry(serve) -> None:
    server, port = await serve(lambda request: None)
    with pytest.raises(HttpError, match="connection"):
        await KeepAliveHttp("127.0.0.1", port).get("/metrics")
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", "HTTP 503"),
        (Hangup(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab"), "connection"),  # cut short
        (b"NOT HTTP AT ALL\r\n\r\n", "malformed"),
    ],
)
async def test_bad_answers_are_errors_and_the_next_get_works(serve, answer: bytes, match: str) -> None:
    answers = iter([answer, ok(b"fine")])
    _, port = await serve(lambda request: next(answers))
    client = KeepAliveHttp("127.0.0.1", port)
    with pytest.raises(HttpError, match=match):
        await client.get("/metrics")
    assert await client.get("/metrics") == b"fine"


async def test_a_refused_connection_is_an_error() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(HttpError, match="cannot connect"):
        await KeepAliveHttp("127.0.0.1", port).get("/metrics")


async def test_a_timeout_drops_the_connection_and_the_next_get_works(serve) -> None:
    answers = iter([SILENT, ok(b"x")])
    server, port = await serve(lambda request: next(answers))
    client = KeepAliveHttp("127.0.0.1", port)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await client.get("/metrics")
    assert await client.get("/metrics") == b"x"
    assert server.connections == 2


def test_the_client_runs_on_uvloop_as_in_the_epp() -> None:
    async def twice() -> list[bytes]:
        server = await asyncio.start_server(
            lambda r, w: Server(lambda request: ok(b"uv")).serve(r, w), "127.0.0.1", 0
        )
        client = KeepAliveHttp("127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            return [await client.get("/metrics"), await client.get("/metrics")]
        finally:
            client.close()
            server.close()

    assert uvloop.run(twice()) == [b"uv", b"uv"]


async def test_a_post_sends_its_body_and_headers_and_any_status_comes_back_with_its_headers() -> None:
    received: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            received.append(head + body)
            writer.write(
                b"HTTP/1.1 201 Created\r\nX-Model-Version: 7\r\nContent-Type: a/b\r\n"
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body[::-1]
            )
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    client = KeepAliveHttp("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        first = await client.request("POST", "/predict", b"rows", {"Content-Type": "x/y"})
        second = await client.request("POST", "/retrain")
    finally:
        client.close()
        server.close()
    assert (first.status, first.body, first.headers["x-model-version"], first.headers["content-type"]) == (
        201,
        b"swor",
        "7",
        "a/b",
    )
    assert received[0].startswith(b"POST /predict HTTP/1.1\r\n")
    assert b"\r\nContent-Type: x/y\r\n" in received[0] and received[0].endswith(
        b"Content-Length: 4\r\n\r\nrows"
    )
    assert second.status == 201 and received[1].endswith(b"Content-Length: 0\r\n\r\n")
