"""A stand-in for the Hugging Face Hub, since the real one cannot be reached here: it serves one
directory's files as every repository, through the few routes ``hf download`` uses (revision
info, file tree, resolve), and records each request's path and Authorization header.

The routes and headers follow what huggingface_hub's client sends and reads; if a later client
needs more, ``hf download`` fails against this fake and the test says so.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_REVISION = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/[^/?]+$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/[^/?]+(\?.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<file>[^/?]+)$")


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@dataclass
class FakeHub:
    files: Path
    url: str = ""
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, Authorization header) of every request."""

    def _tree(self) -> list[dict[str, object]]:
        return [
            {"type": "file", "path": f.name, "size": f.stat().st_size, "oid": _sha1(f.read_bytes())}
            for f in sorted(self.files.iterdir())
            if f.is_file()
        ]

    def answer(self, path: str) -> tuple[bytes, dict[str, str]] | None:
        """The body and extra headers for ``path``, or None for a 404."""
        if m := _REVISION.match(path):
            siblings = [{"rfilename": f["path"]} for f in self._tree()]
            info = {"id": m["repo"], "sha": COMMIT, "siblings": siblings}
            return json.dumps(info).encode(), {"Content-Type": "application/json"}
        if _TREE.match(path):
            return json.dumps(self._tree()).encode(), {"Content-Type": "application/json"}
        if (m := _RESOLVE.match(path)) and (self.files / m["file"]).is_file():
            body = (self.files / m["file"]).read_bytes()
            return body, {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(body)}"'}
        return None


@contextmanager
def serve(files: Path) -> Iterator[FakeHub]:
    """A :class:`FakeHub` for ``files`` on a free loopback port, for the ``with`` block."""
    hub = FakeHub(files)

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self._reply(with_body=False)

        def do_GET(self) -> None:
            self._reply(with_body=True)

        def _reply(self, with_body: bool) -> None:
            hub.requests.append((self.path, self.headers.get("Authorization")))
            answer = hub.answer(self.path)
            body, headers = answer if answer is not None else (b"", {})
            self.send_response(200 if answer is not None else 404)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
