"""Endpoints from Kubernetes: the InferencePool named by ``--pool-name`` and its Ready pods.

Three reflectors feed one :class:`EndpointStore` (the same store the static file feeds):

* the ``InferencePool`` (``inference.networking.k8s.io/v1``): its selector and target ports;
* the pods matching that selector, restarted whenever the selector changes;
* the ``InferenceObjective`` objects, whose priorities for this pool it publishes to an
  :class:`~epp.datalayer.objectives.ObjectivePriorities` (a negative priority marks sheddable
  traffic).

Translation is in :mod:`epp.k8s.pool`; this module only wires reflectors to it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.objectives import ObjectivePriorities
from epp.k8s.pool import PoolError, PoolSpec, label_selector, objective_priorities, parse_pool, pool_endpoints
from epp.k8s.reflector import Backoff, Reflector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ApiGroupVersion:
    group: str
    version: str

    @classmethod
    def parse(cls, api_version: str) -> ApiGroupVersion:
        group, _, version = api_version.partition("/")
        if not group or not version:
            raise ValueError(f"expected GROUP/VERSION, got {api_version!r}")
        return cls(group, version)


POOL_API = ApiGroupVersion("inference.networking.k8s.io", "v1")


@dataclass(frozen=True, slots=True)
class PoolWatch:
    """Which pool to follow and how to watch it."""

    namespace: str
    pool_name: str
    objective_api: ApiGroupVersion
    """The InferenceObjective API version the cluster serves."""
    resync_s: float = 300.0
    """Full relist period of every watch."""
    backoff: Backoff | None = None
    """Retry delays after a failed list or watch (the reflector's default if None)."""


class KubernetesSource:
    """Keeps ``store`` equal to the pool's Ready endpoints, and publishes its objectives'
    priorities to ``priorities``."""

    def __init__(
        self, api: ApiClient, watch: PoolWatch, store: EndpointStore, priorities: ObjectivePriorities
    ) -> None:
        self.store = store
        self.namespace = namespace = watch.namespace
        self.pool_name = pool_name = watch.pool_name
        self.priorities = priorities
        self._core = CoreV1Api(api)
        self._custom = CustomObjectsApi(api)
        self._reflector_options: dict[str, Any] = {"resync_s": watch.resync_s, "backoff": watch.backoff}
        objective_api = watch.objective_api
        self.pool: PoolSpec | None = None
        self.synced = asyncio.Event()
        """Set once the pool and its pods have been listed."""
        self._pool_reflector = Reflector(
            f"inferencepool/{pool_name}",
            functools.partial(
                self._custom.list_namespaced_custom_object,
                POOL_API.group,
                POOL_API.version,
                namespace,
                "inferencepools",
                field_selector=f"metadata.name={pool_name}",
            ),
            self._pool_changed,
            **self._reflector_options,
        )
        self._objective_reflector = Reflector(
            "inferenceobjectives",
            functools.partial(
                self._custom.list_namespaced_custom_object,
                objective_api.group,
                objective_api.version,
                namespace,
                "inferenceobjectives",
            ),
            self._objectives_changed,
            **self._reflector_options,
        )
        self._pods: Reflector | None = None
        self._pods_task: asyncio.Task[None] | None = None
        self._pod_objects: Mapping[str, Any] = {}

    async def run(self) -> None:
        """Watch until cancelled."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pool_reflector.run())
                group.create_task(self._objective_reflector.run())
        finally:
            self._stop_pods()

    def _pool_changed(self) -> None:
        obj = self._pool_reflector.objects.get(f"{self.namespace}/{self.pool_name}")
        if obj is None:
            if self.pool is not None or not self.synced.is_set():
                log.warning("InferencePool %s/%s not found: no endpoints", self.namespace, self.pool_name)
            self.pool = None
            self._stop_pods()
            self._pod_objects = {}
            self.store.replace([])
            return
        try:
            pool = parse_pool(obj)
        except PoolError as exc:
            log.error("keeping the previous pool spec: %s", exc)
            return
        previous, self.pool = self.pool, pool
        if previous is None or previous.match_labels != pool.match_labels:
            log.info("InferencePool %s selects %s, ports %s", self.pool_name, pool.match_labels, pool.ports)
            self._watch_pods(pool)
        self._update_endpoints()

    def _watch_pods(self, pool: PoolSpec) -> None:
        # Until the new watch has listed, the old pods still count if they match the new
        # selector (pool_endpoints filters them by it), so the pool never blinks empty.
        self._stop_pods()
        self._pods = Reflector(
            f"pods[{label_selector(pool.match_labels)}]",
            functools.partial(
                self._core.list_namespaced_pod,
                self.namespace,
                label_selector=label_selector(pool.match_labels),
            ),
            self._pods_changed,
            **self._reflector_options,
        )
        self._pods_task = asyncio.get_running_loop().create_task(self._pods.run(), name="k8s-pods")

    def _stop_pods(self) -> None:
        if self._pods_task is not None:
            self._pods_task.cancel()
        self._pods_task = None
        self._pods = None

    def _pods_changed(self) -> None:
        if self._pods is not None:
            self._pod_objects = self._pods.objects
            self._update_endpoints()

    def _update_endpoints(self) -> None:
        if self.pool is None:
            return
        endpoints = pool_endpoints(self.pool, self._pod_objects.values())
        self.store.replace(endpoints)
        if self._pods is not None and self._pods.synced.is_set() and not self.synced.is_set():
            log.info("InferencePool %s: %d endpoints", self.pool_name, len(endpoints))
            self.synced.set()

    def _objectives_changed(self) -> None:
        self.priorities.publish(
            objective_priorities(self._objective_reflector.objects.values(), self.pool_name)
        )
