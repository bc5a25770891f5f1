"""py-spy flame graphs of a running process, for the benchmarks that profile the EPP."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sim.processes import BIN


@contextmanager
def flame_graph(
    pid: int, path: Path | None, *, rate: int, native: bool = False, raw: bool = False
) -> Iterator[None]:
    """Record process ``pid`` into the SVG ``path`` (with ``raw``: collapsed stacks, one
    ``frame;frame;... count`` line each, every thread's) while the block runs, sampling ``rate``
    times a second (with native frames when ``native``). Nothing is recorded when ``path`` is
    None or py-spy is not installed next to this interpreter."""
    process = None
    if path is not None and (BIN / "py-spy").is_file():
        command = [str(BIN / "py-spy"), "record", "--pid", str(pid), "--rate", str(rate)]
        command += ["--native"] if native else []
        command += ["--format", "raw", "--threads"] if raw else ["--format", "flamegraph"]
        command += ["-o", str(path)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the block's work starts
    try:
        yield
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)  # py-spy writes the graph and exits
            process.wait(30)
