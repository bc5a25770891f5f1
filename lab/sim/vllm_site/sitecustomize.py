"""Imported at start-up by every Python process of a real vLLM replica (``sim.real_vllm`` puts
this directory first on its PYTHONPATH): asks Linux for permission to use AMX tiles.

Linux enables AMX tile data for a process only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; without it the first tile instruction is an illegal instruction. vLLM's
CPU attention runs AMX tiles whenever the CPU has them but never asks, so its engine dies on its
first step unless a library that asks (oneDNN, on some paths) has run first. The permission is
per process, kept across fork and cleared by exec, so each interpreter asks for itself. On a
CPU or kernel without AMX the call fails and changes nothing.
"""

import ctypes
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
