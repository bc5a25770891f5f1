"""The EPP's metrics port: Prometheus' ``/metrics`` plus the live page (``/dashboard``) and its
data (``/dashboard/data``, JSON), on the threaded WSGI server prometheus_client uses itself."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from importlib.resources import files
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from epp.observability.live import LiveData

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
PAGE = files("epp.observability").joinpath("dashboard.html").read_bytes()
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: Prometheus scrapes every few seconds and the page polls every second."""


def metrics_app(registry: CollectorRegistry, live: LiveData) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: the page and its data at their paths, the metrics everywhere else (as before)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in (PAGE_PATH, PAGE_PATH + "/"):
            body, content_type = PAGE, "text/html; charset=utf-8"
        elif path == DATA_PATH:
            body, content_type = orjson.dumps(live.snapshot()), "application/json"
        else:
            return metrics(environ, start_response)
        start_response(
            "200 OK",
            [
                ("Content-Type", content_type),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [body]

    return app


def start_metrics_server(host: str, port: int, registry: CollectorRegistry, live: LiveData) -> WSGIServer:
    """Serve :func:`metrics_app` on ``host:port`` (0: any free port) from a daemon thread; the
    caller calls ``shutdown()`` and ``server_close()``."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server = make_server(host, port, metrics_app(registry, live), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
