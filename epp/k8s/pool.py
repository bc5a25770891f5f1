"""Pure translation of Kubernetes objects into what the EPP schedules on.

The inputs are the JSON objects the API server returns (dicts, as listed or watched); nothing
here does I/O. The shapes are those of ``inference.networking.k8s.io/v1`` ``InferencePool``,
``v1`` ``Pod`` and ``InferenceObjective`` (``v1alpha2``: ``spec.priority``, ``spec.poolRef``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epp.scheduling.types import Endpoint

KubeObject = Mapping[str, Any]
FailureMode = Literal["FailOpen", "FailClose"]


class PoolError(ValueError):
    """The InferencePool object cannot be used (missing or invalid fields)."""


class _Lenient(BaseModel):
    # The API server adds fields over time; we read only what we need.
    model_config = ConfigDict(extra="ignore", frozen=True)


class PortSpec(_Lenient):
    number: int = Field(ge=1, le=65535)


class LabelSelector(_Lenient):
    matchLabels: dict[str, str] = Field(min_length=1)


class EndpointPickerRef(_Lenient):
    name: str
    kind: str = "Service"
    port: PortSpec | None = None
    failureMode: FailureMode = "FailClose"


class PoolSpec(_Lenient):
    """The parts of ``InferencePool.spec`` the EPP acts on."""

    selector: LabelSelector
    targetPorts: list[PortSpec] = Field(min_length=1, max_length=8)
    appProtocol: str | None = None
    endpointPickerRef: EndpointPickerRef | None = None

    @property
    def match_labels(self) -> dict[str, str]:
        return self.selector.matchLabels

    @property
    def ports(self) -> list[int]:
        return [p.number for p in self.targetPorts]


def parse_pool(obj: KubeObject) -> PoolSpec:
    """``InferencePool`` → :class:`PoolSpec`; raise :class:`PoolError` if it is unusable."""
    try:
        return PoolSpec.model_validate(obj.get("spec") or {})
    except ValidationError as exc:
        name = (obj.get("metadata") or {}).get("name", "?")
        raise PoolError(f"InferencePool {name!r}: {exc}") from exc


def label_selector(match_labels: Mapping[str, str]) -> str:
    """The ``labelSelector`` query value for equality-based ``matchLabels``."""
    return ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))


def _is_ready(pod: KubeObject) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _pod_ip(pod: KubeObject) -> str | None:
    address = (pod.get("status") or {}).get("podIP")
    if not address:
        return None
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return None
    return address


def pod_endpoints(pod: KubeObject, pool: PoolSpec) -> list[Endpoint]:
    """The endpoints one pod contributes: one per target port (data-parallel rank) if the pod
    matches the pool's selector, is Running and Ready, is not being deleted and has an IP."""
    metadata = pod.get("metadata") or {}
    labels: dict[str, str] = dict(metadata.get("labels") or {})
    if any(labels.get(key) != value for key, value in pool.match_labels.items()):
        return []
    address = _pod_ip(pod)
    if address is None or not _is_ready(pod):
        return []
    name = metadata["name"]
    ports = pool.ports
    if len(ports) == 1:
        return [Endpoint(name=name, address=address, port=ports[0], labels=labels)]
    return [
        Endpoint(name=f"{name}-rank-{rank}", address=address, port=port, labels=labels)
        for rank, port in enumerate(ports)
    ]


def pool_endpoints(pool: PoolSpec, pods: Iterable[KubeObject]) -> list[Endpoint]:
    """Every endpoint of the pool, ordered by name so the result is deterministic."""
    endpoints = [e for pod in pods for e in pod_endpoints(pod, pool)]
    return sorted(endpoints, key=lambda e: e.name)


def objective_priorities(objectives: Iterable[KubeObject], pool_name: str) -> dict[str, int]:
    """``InferenceObjective`` name → priority, for the objectives that reference ``pool_name``.
    A missing priority is 0; a negative one marks the objective's traffic sheddable."""
    priorities: dict[str, int] = {}
    for obj in objectives:
        spec = obj.get("spec") or {}
        if (spec.get("poolRef") or {}).get("name") != pool_name:
            continue
        priority = spec.get("priority", 0)
        if isinstance(priority, int) and not isinstance(priority, bool):
            priorities[obj["metadata"]["name"]] = priority
    return priorities
