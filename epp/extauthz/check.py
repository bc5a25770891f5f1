"""One ext_authz check: a request's routing as an HTTP answer, apart from the HTTP server.

With ``--envoy-callout ext-authz`` the gateway asks the EPP over Envoy's HTTP ext_authz filter
instead of ext_proc (see ``sim.envoy_config``): one plain HTTP/1.1 request per client request,
carrying the client's method, path (under :data:`CHECK_PATH_PREFIX`), headers and whole body,
and no message at all for the response. The answer:

* **routed**: 200 with the destination header (the pick, then fallbacks, comma-separated, for
  Envoy's ``override_host`` policy), the request id and the lifecycle's upstream headers, which
  Envoy adds to the forwarded request; and the decision trace, when the caller may see one,
  which Envoy adds to the client's response. The request is then handed off to the gateway's
  access log, which finishes it (first token, status, output tokens; ``epp.requestcontrol``).
* **refused**: the error's status, headers and OpenAI-style JSON body, which Envoy sends to the
  client as they are (400, 413, 429, 431, 503, ...).

Envoy adds :data:`SOURCE_HEADER` (the client's address, overriding any the client sent) and
some ``x-envoy-*`` headers of its own to the check; they are not the client's and are dropped
before the request is looked at. Whatever goes wrong inside is a JSON 500 and one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from epp.errors import InternalServerError, PayloadTooLarge, RequestError
from epp.extproc.gate import DEFAULT_GATE, RequestGate
from epp.extproc.messages import DESTINATION_HEADER
from epp.requestcontrol.director import REQUEST_ID_HEADER, Director
from epp.requestcontrol.events import Routed
from epp.requestcontrol.handle import RequestHandle

log = logging.getLogger(__name__)

CHECK_PATH_PREFIX = "/ext-authz"
"""What the gateway puts before the client's path in each check (``path_prefix``)."""
SOURCE_HEADER = "x-llm-epp-source"
"""The client's address, as the gateway adds it to each check."""
GATEWAY_HEADERS = frozenset(
    {SOURCE_HEADER, "x-envoy-internal", "x-envoy-expected-rq-timeout-ms", "x-envoy-auth-partial-body"}
)
"""Headers the gateway adds to a check: not the client's."""
PSEUDO_HEADERS = (":method", ":path", ":scheme")
"""What the client's request also had, as the gateway counts its headers (``:authority`` comes
as ``host``)."""


@dataclass(frozen=True, slots=True)
class Check:
    """A check as the HTTP server read it; header names lowercase, repeated ones comma-joined."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class CheckAnswer:
    status: int
    headers: Mapping[str, str]
    body: bytes = b""


class ExtAuthzCheck:
    """Answers checks by routing them through the director (see the module doc)."""

    def __init__(self, director: Director, max_body_bytes: int, gate: RequestGate = DEFAULT_GATE) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.gate = gate

    async def answer(self, check: Check) -> CheckAnswer:
        headers = dict(check.headers)
        source = headers.get(SOURCE_HEADER)
        for name in GATEWAY_HEADERS:
            headers.pop(name, None)
        path = check.path.removeprefix(CHECK_PATH_PREFIX) or "/"
        sized = [*headers.items(), (":method", check.method), (":path", path), (":scheme", "http")]
        headers = self.gate.debug.filter(headers, source)
        handle = self.director.open(headers)
        try:
            self.gate.limits.check_size(len(sized), sum(len(k) + len(v) for k, v in sized))
            if len(check.body) > self.max_body_bytes:
                raise PayloadTooLarge(f"request body exceeds the limit of {self.max_body_bytes} bytes")
            return await self._route(handle, {**headers, ":path": path, ":method": check.method}, check.body)
        except RequestError as error:
            return self._refuse(handle, error)
        except Exception as exc:
            error = InternalServerError(exc)
            log.error("request %s (ext_authz check): %s", handle.request_id, error.log_message())
            return self._refuse(handle, error)
        finally:
            # A check cancelled (the client went away) or refused is over; a routed one is the
            # access log's now (``hand_off_routed`` marked it finished).
            handle.finish()

    async def _route(self, handle: RequestHandle, headers: dict[str, str], body: bytes) -> CheckAnswer:
        if not body:
            result = handle.schedule_bodyless()
            return self._routed(handle, [t.hostport for t in result.targets])
        targets: list[str] = []
        async for event in handle.schedule(headers[":path"], headers, body):
            if isinstance(event, Routed):  # held or not: the check waits either way
                targets = [t.hostport for t in event.result.targets]
        answer = self._routed(handle, targets)
        handle.hand_off_routed()
        return answer

    def _routed(self, handle: RequestHandle, targets: list[str]) -> CheckAnswer:
        headers = {
            DESTINATION_HEADER: ",".join(targets),
            REQUEST_ID_HEADER: handle.request_id,
            **handle.upstream_headers(),
            **handle.debug_headers(),
        }
        return CheckAnswer(200, headers)

    def _refuse(self, handle: RequestHandle, error: RequestError) -> CheckAnswer:
        handle.reject(error)
        return CheckAnswer(error.status, error.headers(), error.body())
