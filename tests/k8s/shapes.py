"""Kubernetes objects for the tests, made from the real-shaped fixtures in tests/fixtures/k8s.

The fixtures are written in the exact JSON shape the API server returns (metadata with
managedFields and ownerReferences, pod status with conditions and podIPs, InferencePool v1
with status.parents); they are transcribed from that format, not captured from a live cluster,
since none can run here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "k8s"
NAMESPACE = "default"
POOL = "vllm-llama3-8b-instruct"
APP_LABELS = {"app": POOL}


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    obj = _fixture("pod-vllm.json")
    obj["metadata"]["name"] = name
    obj["metadata"]["labels"] = dict(APP_LABELS if labels is None else labels)
    status = obj["status"]
    status["phase"] = phase
    if ip is None:
        del status["podIP"], status["podIPs"]
    else:
        status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
    return set_ready(obj, ready)


def set_ready(obj: dict[str, Any], ready: bool) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for condition in obj["status"]["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    for container in obj["status"]["containerStatuses"]:
        container["ready"] = ready
    return obj


def inference_pool(
    match_labels: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,), name: str = POOL
) -> dict[str, Any]:
    obj = _fixture("inferencepool.json")
    obj["metadata"]["name"] = name
    obj["spec"]["selector"]["matchLabels"] = dict(APP_LABELS if match_labels is None else match_labels)
    obj["spec"]["targetPorts"] = [{"number": p} for p in ports]
    return obj


def inference_objective(name: str, priority: int | None, pool: str = POOL) -> dict[str, Any]:
    obj = _fixture("inferenceobjective.json")
    obj["metadata"]["name"] = name
    obj["spec"]["poolRef"]["name"] = pool
    if priority is None:
        del obj["spec"]["priority"]
    else:
        obj["spec"]["priority"] = priority
    return obj
