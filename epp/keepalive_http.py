"""A keep-alive HTTP/1.1 client for one server: the scraper's GETs and the predictor client's
POSTs, at less than half aiohttp's CPU.

The scraper asks each engine for ``/metrics`` up to 20 times a second, and the predicted-latency
producer calls a predictor for most requests. aiohttp's request machinery (timeouts, connector,
response object, stream reader) cost ~480 µs of CPU a scrape against a busy engine, this ~220 µs
(``llm-epp-bench capacity``'s scrape unit, both on uvloop; docs/capacity.md). What is left is
one connection, a request written as prepared bytes, and httptools (the HTTP parser uvicorn
uses) calling back with the status, headers and body.

Contract: one :class:`KeepAliveHttp` sends one request at a time (callers that want several at
once keep several). :meth:`KeepAliveHttp.request` returns the :class:`Answer` (any status; body
by Content-Length or chunked) or raises :class:`HttpError` (refused or lost connection, a
malformed answer); :meth:`KeepAliveHttp.get` returns the body of a 2xx answer and raises
:class:`HttpError` for any other status. A caller's timeout (``asyncio.timeout``) may cancel a
request at any point: the connection, whose state is then unknown, is dropped. A server that
closed the idle connection (or answered ``Connection: close``) costs a reconnect on the next
request: a reused connection that fails before any byte of the answer is retried once on a new
one, so requests must be safe to send twice (GETs, predictions).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

import httptools


class HttpError(Exception):
    """No answer: no connection, a connection lost or a malformed answer; from :meth:`KeepAliveHttp.get`
    also a non-2xx status."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    """Names in lower case; a repeated header keeps its last value."""


class _Exchange(asyncio.Protocol):
    """One connection; each request's answer is parsed into ``answer``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[Answer] | None = None
        self.answered_any = False
        """Whether a byte of the current request's answer arrived."""
        self._body: list[bytes] = []
        self._headers: dict[str, str] = {}

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        self.answered_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpError(f"malformed answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(HttpError(f"connection lost: {exc}" if exc else "connection closed"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer = Answer(self.parser.get_status_code(), b"".join(self._body), self._headers)
        self._body, self._headers = [], {}
        if not self.parser.should_keep_alive():
            self.close()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(answer)

    def start(self, request: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.answered_any = False
        self._body, self._headers = [], {}
        self.transport.write(request)
        return self.answer

    def _fail(self, error: HttpError) -> None:
        self.close()
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class KeepAliveHttp:
    """Requests to ``host:port`` over one kept-alive connection (see the module's contract)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._exchange: _Exchange | None = None
        self._heads: dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes] = {}
        host_header = f"[{host}]" if ":" in host else host  # an IPv6 address
        self._host_line = f"Host: {host_header}:{port}\r\n"

    async def get(self, path: str) -> bytes:
        """The body of ``path``'s 2xx answer; :class:`HttpError` otherwise."""
        answer = await self.request("GET", path)
        if not 200 <= answer.status < 300:
            raise HttpError(f"HTTP {answer.status} from {path}")
        return answer.body

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> Answer:
        """The answer to one request (``body`` sent with its Content-Length when not empty)."""
        data = self._head(method, path, headers, len(body)) + body
        reused = self._exchange is not None and self._exchange.transport is not None
        try:
            return await self._send(data)
        except HttpError:
            exchange = self._exchange
            if not (reused and exchange is not None and not exchange.answered_any):
                raise
            return await self._send(data)  # the server had closed the idle connection

    async def _send(self, data: bytes) -> Answer:
        exchange = self._exchange
        if exchange is None or exchange.transport is None:
            exchange = self._exchange = await self._connect()
        try:
            return await exchange.start(data)
        except BaseException:  # cancelled (a timeout) or failed: the connection's state is unknown
            exchange.close()
            raise

    async def _connect(self) -> _Exchange:
        loop = asyncio.get_running_loop()
        try:
            _, exchange = await loop.create_connection(_Exchange, self.host, self.port)
        except OSError as exc:
            raise HttpError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return exchange

    def _head(self, method: str, path: str, headers: Mapping[str, str] | None, length: int) -> bytes:
        """The request line and headers, prepared once per method, path and headers."""
        extra = tuple(headers.items()) if headers else ()
        key = (method, path, extra)
        head = self._heads.get(key)
        if head is None:
            lines = "".join(f"{name}: {value}\r\n" for name, value in extra)
            head = self._heads[key] = f"{method} {path} HTTP/1.1\r\n{self._host_line}{lines}".encode()
        if length or method != "GET":
            return head + b"Content-Length: %d\r\n\r\n" % length
        return head + b"\r\n"

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None
