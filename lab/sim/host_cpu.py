"""The CPU this machine runs on, as vLLM's CPU build sees it.

vLLM picks kernels, and some reported settings, from torch's CPU checks (``torch.cpu._is_*``),
which read the ISA extensions from CPUID. Linux lists the same extensions as the ``flags`` of
``/proc/cpuinfo``, so the simulator and the benchmarks decide here as vLLM does there, without
torch. Each check below is torch's, in /proc/cpuinfo's names.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
ISA_CLASSES = ("amx", "avx512-bf16", "avx512", "avx2", "other")
"""CPU classes, best first, by the kernels vLLM's CPU build runs: AMX tiles (its attention,
among others, then uses them), its AVX-512 BF16 build (``vllm._C``), its plain AVX-512 build
(``vllm._C_AVX512``), its AVX2 build (``vllm._C_AVX2``); and any other CPU."""
_AVX512 = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq"})


@dataclass(frozen=True, slots=True)
class HostCpu:
    """A CPU's model name and its ISA extension flags (Linux's names)."""

    model: str
    flags: frozenset[str]

    @property
    def avx512(self) -> bool:
        """torch's ``_is_avx512_supported``: AVX-512 F, VL, BW and DQ."""
        return _AVX512.issubset(self.flags)

    @property
    def avx512_bf16(self) -> bool:
        """torch's ``_is_avx512_bf16_supported``."""
        return "avx512_bf16" in self.flags

    @property
    def amx_tile(self) -> bool:
        """torch's ``_is_amx_tile_supported``."""
        return "amx_tile" in self.flags

    @property
    def isa(self) -> str:
        """The first of ``ISA_CLASSES`` this CPU has."""
        if self.amx_tile and self.avx512_bf16:
            return "amx"
        if self.avx512_bf16:
            return "avx512-bf16"
        if self.avx512:
            return "avx512"
        if "avx2" in self.flags:
            return "avx2"
        return "other"

    @property
    def vllm_mamba_ssm_cache_dtype(self) -> str:
        """The ``mamba_ssm_cache_dtype`` vLLM's CPU platform reports for a model with default cache
        settings: it resets ``auto`` to ``float32`` where AVX-512 BF16 (its accelerated GDN
        kernels) is available, and leaves it elsewhere (``vllm/platforms/cpu.py``)."""
        return "float32" if self.avx512_bf16 else "auto"

    def describe(self) -> str:
        """E.g. ``Intel(R) Xeon(R) Processor (ISA class amx)``."""
        return f"{self.model} (ISA class {self.isa})"


def parse_cpuinfo(text: str) -> HostCpu:
    """The first processor of a ``/proc/cpuinfo`` text (all of a machine's are alike)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    return HostCpu(model=model, flags=frozenset(fields.get("flags", "").split()))


@functools.cache
def host_cpu() -> HostCpu:
    """This machine's CPU; with no /proc/cpuinfo (not Linux), one without known flags."""
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return parse_cpuinfo("")
