"""What the EPP checks in a request's headers before anything else: their size, and whether the
caller may see the decision trace.

**Header limits.** The gateway refuses request headers over its own limits (Envoy's defaults:
100 headers, 60 KiB), but the headers the EPP adds (the destination, the request id, a trace
context) are checked against the same limits after the fact: Envoy then fails a request that
arrived under them with an empty 500. The EPP refuses such a request first, with a JSON 431,
keeping :data:`ADDED_HEADERS` and :data:`ADDED_BYTES` of room under the limits it is given
(``--max-request-headers``, ``--max-request-headers-kb``: the gateway's). Envoy counts every
entry, pseudo-headers included, and sizes them as the lengths of names and values, as here.

**Decision traces** (``x-llm-epp-debug``) name endpoints and scores and tell a caller whether a
prefix sits in some replica's cache, so they are off unless the operator turns them on, and
then only for callers who present the token (``x-llm-epp-debug: <token>``, compared in constant
time) or whose address is in an allowed network (``x-llm-epp-debug: true``). The address is the
ext_proc attribute ``source.address``, which the gateway must send (the local gateway does).
Any other caller's header is dropped unread: the request is served without a trace.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from envoy.config.core.v3.base_pb2 import HeaderMap

from epp.errors import HeadersTooLarge
from epp.requestcontrol.request_headers import DEBUG_HEADER
from wire.auth import read_token

ENVOY_MAX_HEADERS = 100
ENVOY_MAX_HEADERS_KB = 60
"""Envoy's default limits on request headers (``max_headers_count``, ``max_request_headers_kb``)."""
ADDED_HEADERS = 5
"""The most headers the EPP adds to a request: the destination, the request id (when the client
sent none), a W3C trace context (``traceparent``, ``tracestate``) with tracing on, and the
replica's id with sync on (``epp.sync.replica_header``)."""
ADDED_BYTES = 512
"""Room for their names and values (a destination of up to 64 bytes, a 32-byte id, a 55-byte
``traceparent``, a replica id of up to 64): 512 bytes, with margin."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class HeaderLimits:
    """The gateway's limits on request headers, which the EPP's own headers must fit under."""

    max_count: int = ENVOY_MAX_HEADERS
    max_kb: int = ENVOY_MAX_HEADERS_KB

    def check(self, headers: HeaderMap) -> None:
        """Raise :class:`HeadersTooLarge` if ``headers`` leave no room for the EPP's own."""
        count = len(headers.headers)
        room = self.max_kb * 1024 - ADDED_BYTES
        # The encoded size bounds the names' and values' from above: most requests stop here.
        if count + ADDED_HEADERS <= self.max_count and headers.ByteSize() <= room:
            return
        self.check_size(count, sum(len(h.key) + len(h.raw_value or h.value) for h in headers.headers))

    def check_size(self, count: int, size: int) -> None:
        """Raise :class:`HeadersTooLarge` if ``count`` headers whose names and values add up to
        ``size`` bytes leave no room for the EPP's own."""
        room = self.max_kb * 1024 - ADDED_BYTES
        if count + ADDED_HEADERS > self.max_count or size > room:
            raise HeadersTooLarge(
                f"request headers too large: {count} headers of {size} bytes; this gateway takes "
                f"at most {self.max_count - ADDED_HEADERS} headers and "
                f"{self.max_kb * 1024 - ADDED_BYTES} bytes of names and values"
            )


@dataclass(frozen=True)
class DebugAccess:
    """Who may see decision traces: nobody by default."""

    token: str | None = None
    networks: tuple[Network, ...] = ()

    @classmethod
    def from_settings(cls, token_file: Path | None, networks: Sequence[str]) -> DebugAccess:
        """The token read from ``token_file`` (:class:`~wire.auth.TokenFileError` if it cannot
        be read or is empty, once at start-up: a rotated token needs a restart), and the networks."""
        token = read_token(token_file) if token_file is not None else None
        return cls(token, tuple(ipaddress.ip_network(n, strict=False) for n in networks))

    def admits(self, value: str, source: str | None) -> bool:
        """Whether a request whose ``x-llm-epp-debug`` is ``value``, from ``source``, gets a trace."""
        value = value.strip()
        if self.token is not None and hmac.compare_digest(value.encode(), self.token.encode()):
            return True
        if not self.networks or source is None or value.lower() != "true":
            return False
        try:
            address = ipaddress.ip_address(source)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def filter(self, headers: dict[str, str], source: str | None) -> dict[str, str]:
        """``headers`` with ``x-llm-epp-debug`` set to ``true`` for an admitted caller, else removed."""
        value = headers.pop(DEBUG_HEADER, None)
        if value is not None and self.admits(value, source):
            headers[DEBUG_HEADER] = "true"
        return headers


@dataclass(frozen=True)
class RequestGate:
    """The header checks the EPP makes on every request (see the module doc)."""

    limits: HeaderLimits = HeaderLimits()
    debug: DebugAccess = DebugAccess()


DEFAULT_GATE = RequestGate()
"""Envoy's default limits; no decision traces."""
