"""Reading a running Envoy's admin pages: one upstream host's state (``/clusters``), one counter
(``/stats``)."""

from __future__ import annotations

import httpx


def host_stats(admin_port: int, cluster: str, address: str) -> dict[str, str]:
    """Every ``/clusters`` field Envoy shows for ``address`` (``host:port``) in ``cluster``: counters
    such as ``rq_total`` and ``cx_connect_fail``, and ``health_flags``; empty if Envoy has no such host."""
    prefix = f"{cluster}::{address}::"
    lines = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=2).text.splitlines()
    return dict(line[len(prefix) :].split("::", 1) for line in lines if line.startswith(prefix))


def is_healthy(admin_port: int, cluster: str, address: str) -> bool:
    """Whether Envoy would send new requests to ``address``: its health flags say plain ``healthy``."""
    return host_stats(admin_port, cluster, address).get("health_flags") == "healthy"


def stat(admin_port: int, name: str) -> float:
    """The value of the counter or gauge named exactly ``name`` on ``/stats``."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/stats", params={"filter": f"^{name}$"}, timeout=2).text
    found, value = text.strip().split(": ")
    if found != name:
        raise LookupError(f"Envoy has no stat {name!r}: {text!r}")
    return float(value)
