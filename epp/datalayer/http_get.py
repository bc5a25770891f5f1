"""A keep-alive HTTP/1.1 GET client for one server: what the scraper needs, at half aiohttp's CPU.

The scraper asks each engine for ``/metrics`` up to 20 times a second, one request at a time.
aiohttp's request machinery (timeouts, connector, response object, stream reader) cost ~480 µs
of CPU a scrape against a busy engine, this ~220 µs (``llm-epp-bench capacity``'s scrape unit,
both on uvloop; docs/capacity.md). What is left is one connection, a request written as prepared
bytes, and httptools (the HTTP parser uvicorn uses) calling back with the status and body.

Contract: :meth:`KeepAliveGet.get` sends one GET at a time and returns the body of a 2xx answer
(Content-Length or chunked), or raises :class:`HttpGetError` (refused or lost connection, a non-2xx
status, a malformed answer). A caller's timeout (``asyncio.timeout``) may cancel it at any point:
the connection, whose state is then unknown, is dropped. A server that closed the idle connection
(or answered ``Connection: close``) costs a reconnect on the next call: a reused connection that
fails before any byte of the answer is retried once on a new one.
"""

from __future__ import annotations

import asyncio
from typing import cast

import httptools


class HttpGetError(Exception):
    """The GET failed: no connection, a connection lost, a malformed answer or a non-2xx status."""


class _Exchange(asyncio.Protocol):
    """One connection; each request's answer is parsed into ``answer``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.answered_any = False
        """Whether a byte of the current request's answer arrived."""
        self._body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self.answered_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpGetError(f"malformed answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(HttpGetError(f"connection lost: {exc}" if exc else "connection closed"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer, body = self.answer, b"".join(self._body)
        self._body.clear()
        if not self.parser.should_keep_alive():
            self.close()
        if answer is not None and not answer.done():
            answer.set_result((self.parser.get_status_code(), body))

    def start(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.answered_any = False
        self._body.clear()
        self.transport.write(request)
        return self.answer

    def _fail(self, error: HttpGetError) -> None:
        self.close()
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class KeepAliveGet:
    """GETs to ``host:port`` over one kept-alive connection (see the module's contract)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._exchange: _Exchange | None = None
        self._requests: dict[str, bytes] = {}

    async def get(self, path: str) -> bytes:
        """The body of ``path``'s 2xx answer; :class:`HttpGetError` otherwise."""
        reused = self._exchange is not None and self._exchange.transport is not None
        try:
            status, body = await self._send(path)
        except HttpGetError:
            exchange = self._exchange
            if not (reused and exchange is not None and not exchange.answered_any):
                raise
            status, body = await self._send(path)  # the server had closed the idle connection
        if not 200 <= status < 300:
            raise HttpGetError(f"HTTP {status} from {path}")
        return body

    async def _send(self, path: str) -> tuple[int, bytes]:
        exchange = self._exchange
        if exchange is None or exchange.transport is None:
            exchange = self._exchange = await self._connect()
        try:
            return await exchange.start(self._request(path))
        except BaseException:  # cancelled (a timeout) or failed: the connection's state is unknown
            exchange.close()
            raise

    async def _connect(self) -> _Exchange:
        loop = asyncio.get_running_loop()
        try:
            _, exchange = await loop.create_connection(_Exchange, self.host, self.port)
        except OSError as exc:
            raise HttpGetError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return exchange

    def _request(self, path: str) -> bytes:
        request = self._requests.get(path)
        if request is None:
            host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
            request = f"GET {path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n\r\n".encode()
            self._requests[path] = request
        return request

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None
