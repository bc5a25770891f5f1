"""A hostile corpus for the gateway: requests a stranger might send, generated around its limits.

Each :class:`Case` is one request; :func:`corpus` generates them systematically: header counts
0–110 (the limit is 100, less the EPP's room), header sizes around 60 KiB, repeated headers,
wrong methods, paths outside the API, odd content types, scheduling headers out of range, a
client's own destination, bodies empty, junk and over 16 MiB, HTTP/1.0. Request bodies that
vLLM's parser must judge belong to the conformance suite, not here.

:func:`run_with_curl` sends a list of cases with ``curl`` over HTTP/1.1, HTTP/2 (cleartext,
prior knowledge) or HTTP/1.0: curl is the HTTP/2 client at hand (the project's environment has
no ``h2`` for httpx); header blocks too large for curl to send over HTTP/2 go through
:mod:`tests.raw_h2`.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests import raw_h2

COMPLETION = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
CHAT = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
).encode()
JSON = ("content-type", "application/json")
OVER_16_MIB = 17 << 20
Protocol = str  # "1.1", "2" or "1.0"
CURL_H2_MAX_HEADER_BYTES = 60_000
"""curl's nghttp2 will not send a larger header block (it gives up on its own side)."""
_CURL_PROTOCOL = {"1.1": "http1.1", "2": "http2-prior-knowledge", "1.0": "http1.0"}


@dataclass(frozen=True)
class Case:
    name: str
    method: str = "POST"
    path: str = "/v1/completions"
    headers: tuple[tuple[str, str], ...] = (JSON,)
    body: bytes | int | None = COMPLETION
    """The body, or its size for a body of that many zero bytes (a sparse file, never held), or None."""
    protocols: tuple[Protocol, ...] = ("1.1", "2")


@dataclass(frozen=True)
class Answer:
    case: Case
    protocol: Protocol
    status: int
    """0: no response (curl's transfer failed)."""
    content_type: str | None
    """None when the client did not read it."""
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _extra(count: int, value: str = "v", name: str = "x-extra-{}") -> tuple[tuple[str, str], ...]:
    return tuple((name.format(i), value) for i in range(count))


def _header_counts() -> list[Case]:
    cases = [Case(f"{n} extra headers, POST", headers=(JSON, *_extra(n))) for n in range(111)]
    cases += [Case(f"{n} extra headers, GET", "GET", "/v1/models", _extra(n), None) for n in range(111)]
    cases += [
        Case(f"one header repeated {n} times", headers=(JSON, *_extra(n, name="x-same")))
        for n in range(0, 111, 2)
    ]
    return cases


def _header_sizes() -> list[Case]:
    kib = [Case(f"a {k} KiB header", headers=(JSON, ("x-big", "a" * (k << 10)))) for k in range(0, 91, 2)]
    edge = 60 << 10
    near = [
        Case(f"a header of {size} bytes", headers=(JSON, ("x-big", "a" * size)))
        for size in range(edge - 1200, edge + 200, 50)
    ]
    spread = [Case(f"{n} headers of 1 KiB", headers=(JSON, *_extra(n, "b" * 1024))) for n in range(40, 71)]
    long_path = [
        Case(f"a {k} KiB query string", path="/v1/completions?q=" + "q" * (k << 10))
        for k in (1, 8, 30, 59, 70)
    ]
    return kib + near + spread + long_path


def _methods() -> list[Case]:
    cases = []
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "POST", "HEAD"):
            body = None if method in ("GET", "HEAD", "TRACE") else COMPLETION
            cases.append(Case(f"{method} {path}", method, path, (JSON,), body))
    # Over HTTP/2 a CONNECT that carries a path is malformed (RFC 9113 8.5): the codec resets it.
    cases.append(Case("CONNECT", "CONNECT", "/v1/completions", protocols=("1.1",)))
    # An unknown method is an HTTP/1.1 parse error (400); over HTTP/2 it is only a wrong method.
    cases.append(Case("unknown method FOO", "FOO"))
    # Protocol upgrades (HTTP/1.1 only: HTTP/2 forbids the headers), which the gateway does not do.
    for upgrade in ("websocket", "h2c", "TLS/1.2"):
        headers = (JSON, ("connection", "upgrade"), ("upgrade", upgrade))
        cases.append(Case(f"upgrade to {upgrade}", headers=headers, protocols=("1.1",)))
    return cases


def _paths() -> list[Case]:
    paths = [
        "/", "/metrics", "/health", "/healthz", "/ping", "/version", "/tokenize", "/detokenize",
        "/load", "/dashboard", "/dashboard/data", "/kv_event_sources", "/v1/embeddings",
        "/v1/models/tiny", "/v1/completions/", "/v1/completions/x", "//v1/completions",
        "/V1/completions", "/v1//completions", "/v1/completions/../../metrics", "/%2e%2e/metrics",
        "/v1/completions%2f", "/v1/completions?stream=true", "/v1/completions?x=%00",
        "/v1/chat/completions?", "/v1/completions;x", "/../v1/completions", "/v1/%63ompletions",
        "/admin", "/stats", "/server_info", "/config_dump", "/v1/responses", "/v1/audio/transcriptions",
    ]  # fmt: skip
    return [Case(f"path {p}", path=p) for p in paths] + [
        Case(f"GET path {p}", "GET", p, (), None) for p in paths[:12]
    ]


def _content_and_bodies() -> list[Case]:
    types = [
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/json; charset=utf-8", "application/json; charset=latin-1", "application/JSON",
        "application/octet-stream", "*/*", "", "application/json, text/plain",
    ]  # fmt: skip
    cases = [Case(f"content-type {t!r}", headers=(("content-type", t),)) for t in types]
    cases.append(Case("no content-type", headers=()))
    for path, valid in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        cases += [
            Case(f"{path}: valid", path=path, body=valid),
            Case(f"{path}: empty body", path=path, body=b""),
            Case(f"{path}: no body", path=path, body=None),
            Case(f"{path}: junk", path=path, body=b"\x00\xff junk"),
            Case(f"{path}: 4 KiB of zero bytes", path=path, body=4096),
            # Envoy answers 413 mid-upload; over HTTP/2 it then resets the stream (RST_STREAM
            # NO_ERROR, as RFC 9113 8.1 allows), and curl 7.88 at times drops the answer for it.
            Case(f"{path}: over 16 MiB", path=path, body=OVER_16_MIB, protocols=("1.1",)),
            Case(
                f"{path}: chunked",
                path=path,
                headers=(JSON, ("transfer-encoding", "chunked")),
                protocols=("1.1",),
            ),
            Case(f"{path}: expect 100-continue", path=path, headers=(JSON, ("expect", "100-continue"))),
        ]
    return cases


def _scheduling_headers() -> list[Case]:
    values = ["-1", "0", "abc", "1e309", "NaN", "99999999999", "250", " 12.5 ", "1" * 5000]
    cases = [
        Case(f"{name}: {v[:12]!r}", headers=(JSON, (name, v)))
        for name in ("x-slo-ttft-ms", "x-slo-tpot-ms", "x-priority", "x-prediction-based-scheduling")
        for v in values
    ]
    cases += [
        Case(f"x-llm-epp-debug: {v!r}", headers=(JSON, ("x-llm-epp-debug", v)))
        for v in ("true", "false", "maybe", "", "1" * 300)
    ]
    cases += [
        Case(f"x-request-id {v[:12]!r}", headers=(JSON, ("x-request-id", v)))
        for v in ("", "a b", "x" * 129, "../../etc", "dup")
    ]
    cases += [
        Case(f"own destination {v}", headers=(JSON, ("x-gateway-destination-endpoint", v)))
        for v in ("127.0.0.1:1", "10.0.0.1:8000", "evil.example:80", "")
    ]
    cases.append(Case("objective garbage", headers=(JSON, ("x-gateway-inference-objective", "ünïcode"))))
    return cases


def _http_1_0() -> list[Case]:
    return [
        Case("HTTP/1.0 completion", protocols=("1.0",)),
        Case("HTTP/1.0 chat", path="/v1/chat/completions", body=CHAT, protocols=("1.0",)),
        Case("HTTP/1.0 models", "GET", "/v1/models", (), None, ("1.0",)),
        Case("HTTP/1.0 wrong path", path="/metrics", protocols=("1.0",)),
        Case("HTTP/1.0 101 extra headers", headers=(JSON, *_extra(101)), protocols=("1.0",)),
    ]


def corpus() -> list[Case]:
    cases = [
        *_header_counts(),
        *_header_sizes(),
        *_methods(),
        *_paths(),
        *_content_and_bodies(),
        *_scheduling_headers(),
        *_http_1_0(),
    ]
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def header_bytes(case: Case) -> int:
    """The size of ``case``'s header block as HTTP/2 counts it (names, values, 32 each)."""
    return sum(len(k) + len(v.encode()) + 32 for k, v in case.headers) + len(case.path) + 100


def _config_block(i: int, case: Case, protocol: Protocol, workdir: Path) -> str:
    lines = [
        f"url = {_quote(case.path)}",
        f"request = {_quote(case.method)}",
        "path-as-is",
        _CURL_PROTOCOL[protocol],
        f"output = {_quote(str(workdir / f'{i}.body'))}",
        f"dump-header = {_quote(str(workdir / f'{i}.head'))}",
        f"write-out = {_quote(str(i) + ' %{http_code}' + chr(92) + 'n')}",
    ]
    if case.method == "HEAD":
        lines.append("head")
    if "expect" not in dict(case.headers):
        lines.append('header = "expect:"')  # curl's own Expect on large bodies, unless the case sets it
    lines += [f"header = {_quote(f'{k}: {v}' if v else f'{k};')}" for k, v in case.headers]
    if case.body is not None:
        body_file = workdir / f"{i}.req"
        with body_file.open("wb") as out:
            if isinstance(case.body, int):
                out.truncate(case.body)
            else:
                out.write(case.body)
        lines.append(f"data-binary = {_quote('@' + str(body_file))}")
    return "\n".join(lines)


def _curl(base_url: str, blocks: list[str], config: Path) -> dict[str, str]:
    """Run curl on ``blocks`` (one transfer each); each transfer's status by its index."""
    config.write_text(
        "silent\n" + "\nnext\n".join(b.replace('url = "', f'url = "{base_url}', 1) for b in blocks)
    )
    done = subprocess.run(["curl", "--config", str(config)], capture_output=True, text=True, timeout=300)
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.strip())


def run_with_curl(base_url: str, cases: list[Case], protocol: Protocol, workdir: Path) -> list[Answer]:
    """Send ``cases`` over ``protocol`` with curl; its answers, in order. Over HTTP/2, a header
    block curl will not send (``CURL_H2_MAX_HEADER_BYTES``) goes through :mod:`tests.raw_h2`."""
    workdir.mkdir(parents=True, exist_ok=True)
    raw = {i for i, c in enumerate(cases) if protocol == "2" and header_bytes(c) > CURL_H2_MAX_HEADER_BYTES}
    blocks = {i: _config_block(i, c, protocol, workdir) for i, c in enumerate(cases) if i not in raw}
    statuses: dict[str, str] = {}
    if protocol == "2":
        # curl 7.88 fails every prior-knowledge HTTP/2 transfer after the first in one process
        # ("Error in the HTTP2 framing layer"), so HTTP/2 takes one process per case.
        with ThreadPoolExecutor(6) as pool:
            for found in pool.map(lambda i: _curl(base_url, [blocks[i]], workdir / f"{i}.conf"), blocks):
                statuses.update(found)
    else:
        statuses = _curl(base_url, list(blocks.values()), workdir / "curl.conf")
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return [
        _raw_answer(case, host, int(port))
        if i in raw
        else _answer(case, protocol, int(statuses.get(str(i), "0")), workdir / str(i))
        for i, case in enumerate(cases)
    ]


def _raw_answer(case: Case, host: str, port: int) -> Answer:
    assert case.method == "POST" and isinstance(case.body, bytes), "the raw client sends POSTs only"
    reply = raw_h2.request(host, port, case.path, list(case.headers), case.body)
    # The raw client reads no response header but :status, so the content type goes unchecked.
    return Answer(case, "2", reply.status or 0, None, reply.body)


def _answer(case: Case, protocol: Protocol, status: int, stem: Path) -> Answer:
    head = stem.with_suffix(".head")
    headers: dict[str, str] = {}
    if head.exists():
        # The last response's headers (after any 100 Continue).
        block = head.read_text(errors="replace").strip().split("\r\n\r\n")[-1]
        for line in block.splitlines()[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = stem.with_suffix(".body")
    return Answer(
        case,
        protocol,
        status,
        headers.get("content-type", ""),
        body.read_bytes() if body.exists() else b"",
        headers,
    )
