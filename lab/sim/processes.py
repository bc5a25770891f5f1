"""Child processes for local stacks and benchmarks: spawn in their own group, tied to this
process's life, wait, stop."""

from __future__ import annotations

import ctypes.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

BIN = Path(sys.executable).parent
# Every child gets this signal when the process that spawned it dies, even by SIGKILL, so a
# stack killed hard leaves no replica, EPP or Envoy holding its ports. SIGTERM, not SIGKILL:
# each program then ends its own children (vLLM's engine core) as on a normal stop.
PARENT_DEATH_SIGNAL = signal.SIGTERM
DIE_WITH_PARENT = Path(__file__).with_name("die_with_parent.py")


class ProcessError(RuntimeError):
    """A child process failed to start or died."""


# Ports handed out for test and bench processes come from below Linux's ephemeral range
# (32768-60999), so they never collide with the source ports of outgoing connections, which
# processes starting in parallel (vLLM opens many) grab between our probe and their bind.
_PORT_RANGE = (20_000, 32_000)
_rng = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_in_use(port: int) -> bool:
    """Whether a server could not bind loopback ``port`` now. Servers set SO_REUSEADDR, so only a
    socket still bound there counts, not connections left in TIME_WAIT."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


_handed_out: set[int] = set()
"""Ports this process has given out: callers that have not bound theirs yet (a stack's ports are
all chosen before its processes start) must not get the same one."""


def free_port() -> int:
    for _ in range(200):
        port = _rng.randrange(*_PORT_RANGE)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise ProcessError("found no free port")


def free_port_range(count: int) -> int:
    """First of ``count`` consecutive free loopback ports (for a multi-replica simulator)."""
    for _ in range(50):
        first = _rng.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        ports = range(first, first + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return first
    raise ProcessError(f"found no {count} consecutive free ports")


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass


def spawn(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Component:
    """Start ``argv`` in a new process group, output to ``log_dir/name.log``. It gets
    :data:`PARENT_DEATH_SIGNAL` when this process dies; call from the main thread (or one that
    outlives the child), since the kernel ties that signal to the forking thread."""
    log_path = log_dir / f"{name}.log"
    guard = [sys.executable, "-S", str(DIE_WITH_PARENT), str(os.getpid()), str(int(PARENT_DEATH_SIGNAL))]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*guard, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    return Component(name, process, log_path)


def wait_until(component: Component, ready: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``ready`` until it returns True; fail early if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not component.alive():
            raise ProcessError(f"{component.name} exited during start-up:\n{component.log_tail()}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ProcessError(f"{component.name} not ready after {timeout:.0f}s:\n{component.log_tail()}")


def http_ok(url: str) -> Callable[[], bool]:
    return lambda: httpx.get(url, timeout=1).is_success


def envoy_live(admin_port: int) -> Callable[[], bool]:
    return lambda: httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).text.strip() == "LIVE"


def envoy_binary() -> str:
    candidate = BIN / "envoy"
    return str(candidate) if candidate.exists() else "envoy"


def start_envoy(
    name: str, bootstrap: dict[str, Any], log_dir: Path, *, admin_port: int = 0, concurrency: int = 2
) -> Component:
    """Run Envoy on ``bootstrap`` with an admin listener (on a free port unless given); wait until live."""
    admin = admin_port or free_port()
    bootstrap = {
        **bootstrap,
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
    }
    path = log_dir / f"{name}.json"
    path.write_text(json.dumps(bootstrap, indent=1))
    argv = [
        envoy_binary(),
        "-c",
        str(path),
        "--log-level",
        "warn",
        "--concurrency",
        str(concurrency),
        "--base-id",
        str(admin),
    ]
    component = spawn(name, argv, log_dir)
    wait_until(component, envoy_live(admin))
    return component


def write_endpoints_file(
    path: Path,
    endpoints: Sequence[tuple[str, int]],
    kv_events: Sequence[tuple[str, str | None]] | None = None,
    labels: Sequence[Mapping[str, str]] | None = None,
) -> Path:
    """Atomically write the EPP's static endpoints file (names ``replica-0`` ...), with each
    endpoint's KV-events (publisher, replay) sockets and labels when given."""
    entries: list[dict[str, Any]] = [
        {"name": f"replica-{i}", "address": a, "port": p} for i, (a, p) in enumerate(endpoints)
    ]
    for entry, (events, replay) in zip(entries, kv_events or (), strict=False):
        entry.update(kv_events_endpoint=events, kv_events_replay_endpoint=replay)
    for entry, endpoint_labels in zip(entries, labels or (), strict=False):
        entry["labels"] = dict(endpoint_labels)
    spec = {"endpoints": entries}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(spec))
    tmp.replace(path)
    return path


EPP_ALLOCATOR = "libmimalloc.so.2"
"""Preloaded into the EPP (Debian's libmimalloc2.0; ``make install`` and the image add it). The
tokenizer spends about half its time in glibc's malloc and free; mimalloc cuts its CPU by ~40%."""


def epp_allocator_env() -> dict[str, str]:
    """The environment that preloads :data:`EPP_ALLOCATOR`; raises when it is not installed."""
    if ctypes.util.find_library("mimalloc") is None:
        raise ProcessError(f"{EPP_ALLOCATOR} is not installed: run `make system-packages`")
    return {"LD_PRELOAD": EPP_ALLOCATOR}


def start_epp(
    log_dir: Path,
    endpoints_file: Path,
    *,
    grpc_port: int,
    health_port: int,
    metrics_port: int,
    expected_endpoints: int,
    tokenizer: Path | Literal["auto", "estimate"],
    extra_args: Sequence[str] = (),
    name: str = "epp",
    env: Mapping[str, str] | None = None,
) -> Component:
    """Run the EPP (logging to ``name``.log), tokenizing with the model in the ``tokenizer``
    directory, or with ``--tokenizer-source auto`` or ``estimate``, with ``env`` added to its
    environment, and wait until it has scraped ``expected_endpoints`` healthy endpoints."""
    argv = [
        str(BIN / "llm-epp"),
        "--host",
        "127.0.0.1",
        "--endpoints-file",
        str(endpoints_file),
        "--grpc-port",
        str(grpc_port),
        "--health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        "--endpoints-poll-s",
        "0.2",
        *(
            ["--tokenizer-source", tokenizer]
            if isinstance(tokenizer, str)
            else ["--tokenizer-dir", str(tokenizer)]
        ),
        *extra_args,
    ]
    component = spawn(name, argv, log_dir, env={**epp_allocator_env(), **(env or {})})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def ready() -> bool:
        for line in httpx.get(metrics_url, timeout=1).text.splitlines():
            if line.startswith("inference_pool_ready_pods"):
                return float(line.rsplit(" ", 1)[1]) >= expected_endpoints
        return False

    wait_until(component, ready)
    return component
