"""This machine's CPU as the simulator reads it (/proc/cpuinfo) and as vLLM reads it (torch), and
the environment real vLLM runs in here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sim.host_cpu import host_cpu
from sim.real_vllm import VllmReplicaSpec, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

TORCH_CHECKS = (
    "import json, torch; c = torch.cpu; print(json.dumps({'avx512': c._is_avx512_supported(), "
    "'avx512_bf16': c._is_avx512_bf16_supported(), 'amx_tile': c._is_amx_tile_supported()}))"
)
# arch_prctl(ARCH_GET_XCOMP_PERM): the extended states this process may use; bit 18 is AMX tile data.
XCOMP_PERM = (
    "import ctypes; perm = ctypes.c_uint64(); "
    "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(perm)); print(perm.value >> 18 & 1)"
)


def run_vllm_python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(vllm_python()), "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_the_simulator_reads_the_cpu_as_vllms_torch_does() -> None:
    cpu = host_cpu()
    torch_sees = json.loads(run_vllm_python(TORCH_CHECKS))
    assert torch_sees == {"avx512": cpu.avx512, "avx512_bf16": cpu.avx512_bf16, "amx_tile": cpu.amx_tile}


def test_vllms_processes_may_use_amx_where_the_cpu_has_it(tmp_path: Path) -> None:
    spec = VllmReplicaSpec(port=0, workdir=tmp_path)
    granted = run_vllm_python(XCOMP_PERM, env={**os.environ, **spec.env()})
    assert granted == ("1" if host_cpu().amx_tile else "0")
