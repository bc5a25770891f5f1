"""Other work on a small shared machine, as it affects a measurement (Linux /proc).

Other work preempts the server being measured, and every moment it is runnable but not running
is added to the durations it reports. The kernel counts that time per thread
(``/proc/<pid>/schedstat``: time on a CPU, time waiting on a run queue, in ns); taking it out of
a measured duration leaves what the step would have taken on an otherwise idle machine. The main
thread is the one that matters: it runs vLLM's engine loop (with ``OMP_NUM_THREADS=1`` the forward
pass too) and the simulator's event loop. Measurements are best started when the machine is idle
(``wait_until_idle``).
"""

from __future__ import annotations

import time
from pathlib import Path

PROC = Path("/proc")


def oncpu_s(pid: int) -> float:
    """Seconds the process's main thread has spent running on a CPU (its schedstat)."""
    return int((PROC / str(pid) / "schedstat").read_text().split()[0]) / 1e9


def sibling_threads_oncpu_s(pid: int) -> float:
    """Seconds on a CPU of ``pid``'s other threads that carry its main thread's name: those it
    started itself after naming the process (vLLM's EngineCore input and output threads), not the
    workers of libraries that name theirs (gloo, ZMQ)."""
    name = (PROC / str(pid) / "comm").read_text()
    total = 0
    for task in (PROC / str(pid) / "task").iterdir():
        try:
            if task.name != str(pid) and (task / "comm").read_text() == name:
                total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue  # the thread exited meanwhile
    return total / 1e9


def runqueue_wait_s(pid: int) -> float:
    """Seconds the main thread of ``pid`` has been runnable but not running, since it started."""
    return int((PROC / str(pid) / "schedstat").read_text().split()[1]) / 1e9


def child_pid(parent: int, name: str) -> int:
    """The child of ``parent`` whose command name (``comm``, at most 15 characters) starts ``name``."""
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            comm, fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue  # exited meanwhile
        if int(fields.split()[1]) == parent and comm.split("(", 1)[1].startswith(name[:15]):
            return int(stat.parent.name)
    raise LookupError(f"process {parent} has no child named {name!r}")


def busy_fraction(interval_s: float = 2.0) -> float:
    """Share of all CPUs' time spent busy over the next ``interval_s`` (0 to 1)."""

    def totals() -> tuple[int, int]:
        fields = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle and iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    busy_before, total_before = totals()
    time.sleep(interval_s)
    busy_after, total_after = totals()
    return (busy_after - busy_before) / max(1, total_after - total_before)


def wait_until_idle(max_busy: float = 0.25, timeout_s: float = 45.0) -> float:
    """Wait (up to ``timeout_s``) until the CPUs are at most ``max_busy`` busy; the last reading."""
    deadline = time.monotonic() + timeout_s
    while (busy := busy_fraction()) > max_busy and time.monotonic() < deadline:
        pass
    return busy
