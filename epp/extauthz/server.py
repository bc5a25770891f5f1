"""The HTTP/1.1 server the gateway's ext_authz filter calls (see ``epp.extauthz.check``).

A plain asyncio protocol over ``httptools`` (the C parser uvicorn uses) rather than a web
framework: a check is one small request on a kept-alive connection from Envoy, and what this
server costs per check is what the callout costs the EPP. Envoy sends one check at a time per
connection; answers still go out in order if a client pipelines. A connection that closes
mid-check (Envoy gave up on it: the client went away, or its timeout passed) cancels the check,
which the director then finishes as not served. ``GET`` :data:`READY_PATH` (outside the checks'
path prefix) answers 200 while the EPP is ready and 503 otherwise: the gateway's health check of
the EPP replicas' check ports (``sim.envoy_config.with_epp_replicas``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

import httptools

from epp.errors import BadRequest
from epp.extauthz.check import Check, CheckAnswer

log = logging.getLogger(__name__)

Answerer = Callable[[Check], Awaitable[CheckAnswer]]
READY_PATH = "/ready"
_READY = CheckAnswer(200, {})
_NOT_READY = CheckAnswer(503, {})


def encode(answer: CheckAnswer, keep_alive: bool) -> bytes:
    """``answer`` as an HTTP/1.1 response."""
    try:
        phrase = HTTPStatus(answer.status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {answer.status} {phrase}"]
    lines += [f"{name}: {value}" for name, value in answer.headers.items()]
    lines.append(f"content-length: {len(answer.body)}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + answer.body


_BAD = BadRequest("malformed HTTP request")
_MALFORMED = CheckAnswer(_BAD.status, _BAD.headers(), _BAD.body())


class CheckProtocol(asyncio.Protocol):
    """One connection from the gateway."""

    def __init__(self, answer: Answerer, ready: Callable[[], bool]) -> None:
        self._answer = answer
        self._ready = ready
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._last: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one, not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self._tasks:
            task.cancel()
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(encode(_MALFORMED, keep_alive=False))
                self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = self._headers.get(key)
        self._headers[key] = text if previous is None else f"{previous},{text}"

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        check = Check(
            method=self._parser.get_method().decode("latin-1"),
            path=httptools.parse_url(self._url).path.decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body),
        )
        keep_alive = self._parser.should_keep_alive()
        if check.path == READY_PATH and check.method == "GET" and self._transport is not None:
            self._transport.write(encode(_READY if self._ready() else _NOT_READY, keep_alive))
            return
        task = asyncio.get_running_loop().create_task(self._respond(check, keep_alive, self._last))
        self._last = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respond(self, check: Check, keep_alive: bool, previous: asyncio.Task[None] | None) -> None:
        answer = await self._answer(check)
        if previous is not None and not previous.done():
            await asyncio.wait((previous,))
        if self._transport is None:
            return
        self._transport.write(encode(answer, keep_alive))
        if not keep_alive:
            self._transport.close()


async def serve(answer: Answerer, ready: Callable[[], bool], host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` (0: any free port; the server's sockets say which)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: CheckProtocol(answer, ready), host, port)
