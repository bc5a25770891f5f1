"""One real vLLM replica or one simulated replica on a free loopback port, for sim-vs-real benches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sim.fitting.cpu_contention import child_pid
from sim.processes import BIN, free_port, http_ok, spawn, wait_until
from sim.real_vllm import VllmReplicaSpec, start_vllm_replicas


@dataclass(frozen=True, slots=True)
class RunningServer:
    url: str
    engine_pid: int
    """The process whose main thread steps the engine (vLLM's EngineCore; the simulator itself)."""
    frontend_pid: int
    """The process whose main thread serves HTTP (vLLM's API server; the simulator itself)."""


@contextmanager
def vllm_server(workdir: Path) -> Iterator[RunningServer]:
    """A real vLLM replica (``sim.real_vllm``'s tiny-model configuration)."""
    spec = VllmReplicaSpec(port=free_port(), workdir=workdir)
    [component] = start_vllm_replicas([spec], ["vllm"])
    try:
        engine_pid = child_pid(component.process.pid, "VLLM::EngineCore")
        yield RunningServer(f"http://127.0.0.1:{spec.port}", engine_pid, component.process.pid)
    finally:
        component.stop()


@contextmanager
def sim_server(workdir: Path, profile: str | Path) -> Iterator[RunningServer]:
    """``llm-epp-sim`` with one replica on ``profile`` (a shipped name or a file)."""
    port = free_port()
    argv = [str(BIN / "llm-epp-sim"), "--port", str(port), "--profile", str(profile), "--log-level", "error"]
    component = spawn("sim", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(component, http_ok(f"{url}/health"))
        yield RunningServer(url, component.process.pid, component.process.pid)
    finally:
        component.stop()
