"""wrk drives the body we give it and its summary is read back."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from bench.harness.wrk import parse_summary, post

BODY = json.dumps({"model": "tiny", "prompt": 'say "hi"\n\tthen é \\ bye', "max_tokens": 1}).encode()


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Echo.bodies.append(body)
        status = 200 if json.loads(body) == json.loads(BODY) else 400
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def test_wrk_posts_the_exact_body_and_counts_answers() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = post(f"http://127.0.0.1:{server.server_port}/v1/completions", BODY, 2, 1)
    finally:
        server.shutdown()
    assert result.requests > 10 and result.errors == 0 and result.status_errors == 0
    assert _Echo.bodies and set(_Echo.bodies) == {BODY}
    assert 0 < result.p50_ms <= result.p99_ms


def test_a_run_without_a_summary_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no summary"):
        parse_summary("Running 1s test @ http://x\n")
