"""``llm-epp-stack`` killed hard takes its children with it, so a new stack on the same ports
starts and serves; a port held by a foreign process stops a stack before it starts anything."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from sim.processes import (
    BIN,
    DIE_WITH_PARENT,
    Component,
    ProcessError,
    free_port,
    port_in_use,
    spawn,
    wait_until,
)
from sim.stack import LocalStack, StackConfig, StackPorts, port_flag
from tests.support import wait_for

pytestmark = pytest.mark.integration


def _stack_argv(ports: StackPorts) -> list[str]:
    argv = [str(BIN / "llm-epp-stack"), "--replicas", "1", "--predictors", "0", "--sim-profile", "instant"]
    for name, port in dataclasses.asdict(ports).items():
        argv += [port_flag(name), str(port)]
    return argv


def _start_stack(name: str, ports: StackPorts, log_dir: Path) -> Component:
    stack = spawn(name, _stack_argv(ports), log_dir)
    wait_until(stack, lambda: "Gateway ready" in stack.log_path.read_text(), timeout=90)
    return stack


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(command name, state, parent pid) of ``pid`` from /proc, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return name, rest[0], int(rest[1])


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting for its reaper."""
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def _children(parent: int) -> dict[int, str]:
    """Live child processes of ``parent`` → their command names."""
    children = {}
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[2] == parent and stat[1] != "Z":
            children[int(entry.name)] = stat[0]
    return children


def _complete(ports: StackPorts) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports.gateway}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model="tiny", prompt="Hello", max_tokens=4, timeout=30)


def test_a_stack_killed_hard_leaves_no_process_and_a_new_one_starts_on_its_ports(tmp_path: Path) -> None:
    ports = StackPorts(*(free_port() for _ in range(8)))
    first = _start_stack("stack-1", ports, tmp_path)
    try:
        children = _children(first.process.pid)
        assert sorted(children.values()) == ["envoy", "llm-epp", "llm-epp-sim"], children
        assert _complete(ports).usage.completion_tokens == 4

        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        assert wait_for(lambda: not any(_alive(pid) for pid in children), timeout=20), [
            (pid, children[pid]) for pid in children if _alive(pid)
        ]
        used = [ports.gateway, ports.epp_grpc, ports.epp_health, ports.epp_metrics, ports.envoy_admin]
        assert not [port for port in [*used, ports.first_replica] if port_in_use(port)]

        second = _start_stack("stack-2", ports, tmp_path)
        try:
            assert _complete(ports).usage.completion_tokens == 4
        finally:
            second.stop()
        assert second.process.returncode == 0, second.log_tail()
    finally:
        first.stop()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_port_held_by_another_process_stops_the_stack_before_it_starts_anything(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        ports = dataclasses.replace(StackPorts.free(), epp_metrics=held)
        stack = LocalStack(StackConfig(replicas=1, ports=ports, workdir=tmp_path))
        with pytest.raises(ProcessError, match=f"port {held} is in use .*--epp-metrics-port"):
            stack.start()
    assert stack.components() == []
    assert not list(tmp_path.glob("*.log"))


def test_a_child_whose_parent_died_before_it_was_guarded_does_not_start(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    gone_parent = str(os.getpid() + 1)  # anything but the real parent: as if it had died
    argv = [sys.executable, "-S", str(DIE_WITH_PARENT), gone_parent, "15", "touch", str(marker)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert f"parent {gone_parent} is gone" in result.stderr
    assert not marker.exists()
