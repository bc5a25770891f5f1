"""Exec a command that gets a signal when the process that started it dies (Linux).

Usage: ``python -S die_with_parent.py PARENT_PID SIGNAL COMMAND [ARG ...]``

``prctl(PR_SET_PDEATHSIG)`` outlives ``exec``, so COMMAND itself is signalled when its parent
ends, even by SIGKILL, which no handler in the parent can catch. The kernel ties the signal to
the parent's *thread* that forked, so start children from a thread that lives as long as they
should. Standard library only: it runs before every child, with ``-S``, and must start fast.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, signal_number, command = int(argv[0]), int(argv[1]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # the parent died before prctl, so no signal will come
        sys.exit(f"die_with_parent: parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
