"""The CPU as vLLM's CPU build sees it, from /proc/cpuinfo: both sides of each of vLLM's rules."""

from __future__ import annotations

import pytest

from sim.host_cpu import HostCpu, parse_cpuinfo

# /proc/cpuinfo, abridged, of the two kinds of machine the project has run on (two cores each).
XEON_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_AVX2 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2

processor\t: 1
model name\t: AMD EPYC Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""


def test_reads_the_model_and_flags_of_the_first_processor() -> None:
    cpu = parse_cpuinfo(XEON_AMX)
    assert cpu.model == "Intel(R) Xeon(R) Processor"
    assert {"avx2", "avx512_bf16", "amx_tile"} <= cpu.flags
    assert parse_cpuinfo(EPYC_AVX2) == HostCpu(
        "AMD EPYC Processor", frozenset({"fpu", "sse2", "avx", "avx2", "fma", "bmi2"})
    )


def test_an_avx512_machine_with_amx() -> None:
    cpu = parse_cpuinfo(XEON_AMX)
    assert (cpu.avx512, cpu.avx512_bf16, cpu.amx_tile, cpu.isa) == (True, True, True, "amx")
    assert cpu.vllm_mamba_ssm_cache_dtype == "float32"
    assert cpu.describe() == "Intel(R) Xeon(R) Processor (ISA class amx)"


def test_an_avx2_machine() -> None:
    cpu = parse_cpuinfo(EPYC_AVX2)
    assert (cpu.avx512, cpu.avx512_bf16, cpu.amx_tile, cpu.isa) == (False, False, False, "avx2")
    assert cpu.vllm_mamba_ssm_cache_dtype == "auto"


@pytest.mark.parametrize(
    ("flags", "isa", "mamba_ssm_cache_dtype"),
    [
        ("avx2 avx512f avx512vl avx512bw avx512dq avx512_bf16", "avx512-bf16", "float32"),
        ("avx2 avx512f avx512vl avx512bw avx512dq", "avx512", "auto"),
        ("avx2 avx512f", "avx2", "auto"),  # torch's AVX-512 needs F, VL, BW and DQ
        ("sse2 avx", "other", "auto"),
    ],
)
def test_the_classes_between(flags: str, isa: str, mamba_ssm_cache_dtype: str) -> None:
    cpu = HostCpu("some CPU", frozenset(flags.split()))
    assert (cpu.isa, cpu.vllm_mamba_ssm_cache_dtype) == (isa, mamba_ssm_cache_dtype)


def test_no_cpuinfo_means_no_known_extensions() -> None:
    cpu = parse_cpuinfo("")
    assert (cpu.flags, cpu.isa, cpu.vllm_mamba_ssm_cache_dtype) == (frozenset(), "other", "auto")
    assert cpu.model
