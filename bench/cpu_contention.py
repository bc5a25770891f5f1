"""How long a process's main thread waited for a CPU (Linux schedstat).

On a small shared machine other work preempts the server being measured, and every step it is
runnable but not running is added to the durations it reports. The kernel counts that time per
thread (``/proc/<pid>/schedstat``: time on a CPU, time waiting on a run queue, in ns); taking it
out of a measured duration leaves what the step would have taken on an otherwise idle machine.
The main thread is the one that matters: it runs vLLM's engine loop (with ``OMP_NUM_THREADS=1``
the forward pass too), the API server's event loop, and the simulator's.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


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
