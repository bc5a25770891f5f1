"""A fake Kubernetes API server: in memory, in process, over real HTTP on loopback.

It is a fake because no real API server can run here (no cluster, no etcd, no kind). It
speaks the parts of the real protocol that the EPP's watches and Helm use, with the real
wire shapes:

* discovery (``/version``, ``/api``, ``/apis``, ``/api/v1``, ``/apis/GROUP/VERSION``);
* ``LIST`` with ``labelSelector`` (equality terms) and ``fieldSelector=metadata.name=…``,
  returning a ``…List`` with ``metadata.resourceVersion``;
* ``WATCH`` (``?watch=true&resourceVersion=N``): one JSON event per line, from history;
  a version older than the compaction point gets an ``ERROR`` event with a 410 ``Status``
  (``reason: Expired``), as the real server sends; ``timeoutSeconds`` ends the stream;
* ``GET``/``POST``/``PUT``/``PATCH`` (merge patch)/``DELETE`` on objects; ``PUT`` with a stale
  ``metadata.resourceVersion`` is a 409 Conflict, ``POST`` of an existing name a 409
  AlreadyExists; every error body is a ``Status`` object.

Test hooks: :meth:`compact` (expire old versions), :meth:`fail_requests` (answer 500s),
:meth:`stop` / :meth:`start` on the same port (an outage that drops open watches).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web


@dataclass(frozen=True, slots=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "pods", "Pod"),
    Resource("", "v1", "services", "Service"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount"),
    Resource("", "v1", "configmaps", "ConfigMap"),
    Resource("", "v1", "secrets", "Secret"),
    Resource("", "v1", "namespaces", "Namespace", namespaced=False),
    Resource("apps", "v1", "deployments", "Deployment"),
    Resource("coordination.k8s.io", "v1", "leases", "Lease"),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    Resource(
        "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False
    ),
    Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"),
    Resource("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective"),
    Resource("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"),
    Resource("monitoring.googleapis.com", "v1", "podmonitorings", "PodMonitoring"),
    Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor"),
    Resource("monitoring.coreos.com", "v1", "prometheusrules", "PrometheusRule"),
    Resource("networking.gke.io", "v1", "healthcheckpolicies", "HealthCheckPolicy"),
    Resource("networking.gke.io", "v1", "gcpbackendpolicies", "GCPBackendPolicy"),
    Resource("networking.istio.io", "v1", "destinationrules", "DestinationRule"),
    Resource("gateway.networking.k8s.io", "v1", "backendtlspolicies", "BackendTLSPolicy"),
    Resource("cert-manager.io", "v1", "certificates", "Certificate"),
)


@dataclass(frozen=True, slots=True)
class Event:
    version: int
    resource: Resource
    kind: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    previous: dict[str, Any] | None


EXPIRED = "expired"  # queued to open watches by compact()
_GO_TRUE = ("1", "t", "T", "true", "TRUE", "True")  # what Go's strconv.ParseBool takes as true


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _error(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status(code, reason, message), status=code)


def _matches(obj: dict[str, Any], label_selector: str | None, field_selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (label_selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value.lstrip("="):
            return False
    for term in filter(None, (field_selector or "").split(",")):
        key, _, value = term.partition("=")
        if key == "metadata.name" and obj["metadata"]["name"] != value:
            return False
        if key == "metadata.namespace" and obj["metadata"].get("namespace") != value:
            return False
    return True


class FakeApiServer:
    def __init__(self, resources: Iterable[Resource] = RESOURCES) -> None:
        self.resources = {(r.group, r.version, r.plural): r for r in resources}
        self.objects: dict[tuple[Resource, str, str], dict[str, Any]] = {}
        self.history: list[Event] = []
        self.compacted = 0
        self.expired_watches = 0
        self._version = itertools.count(1000)
        self.resource_version = next(self._version)
        self._watchers: set[asyncio.Queue[Event | str | None]] = set()
        self._failures: list[int] = []
        self.requests: list[tuple[str, str]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        """Go down: open watches are cut, new connections refused (until :meth:`start`)."""
        for queue in list(self._watchers):
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
            ],
            "current-context": "fake",
        }

    # -- test hooks -----------------------------------------------------------------------

    def resource(self, kind: str) -> Resource:
        return next(r for r in self.resources.values() if r.kind == kind)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object as a controller would (no version check)."""
        resource = self.resource(obj["kind"])
        key = (resource, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        return self._store(resource, key, copy.deepcopy(obj), "MODIFIED" if key in self.objects else "ADDED")

    def delete(self, kind: str, namespace: str, name: str) -> None:
        resource = self.resource(kind)
        obj = self.objects.pop((resource, namespace, name))
        self._emit(resource, "DELETED", obj, obj)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((self.resource(kind), namespace, name))

    def compact(self) -> None:
        """Forget the history so far: new watches from older versions get 410 Expired, and so
        do the open ones (as the real server tells a watcher its window has moved past)."""
        self.compacted = self.resource_version
        self.history.clear()
        for queue in list(self._watchers):
            queue.put_nowait(EXPIRED)

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    @property
    def failures_left(self) -> int:
        return len(self._failures)

    def fail_requests(self, count: int, status: int = 500) -> None:
        """Answer the next ``count`` requests with ``status``."""
        self._failures.extend([status] * count)

    # -- storage --------------------------------------------------------------------------

    def _store(
        self, resource: Resource, key: tuple[Resource, str, str], obj: dict[str, Any], kind: str
    ) -> dict:
        self.resource_version = next(self._version)
        metadata = obj.setdefault("metadata", {})
        metadata["resourceVersion"] = str(self.resource_version)
        metadata.setdefault("uid", f"uid-{key[1]}-{key[2]}")
        metadata.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        metadata.setdefault("generation", 1)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        previous = self.objects.get(key)
        self.objects[key] = obj
        self._emit(resource, kind, obj, previous)
        return obj

    def _emit(
        self, resource: Resource, kind: str, obj: dict[str, Any], previous: dict[str, Any] | None
    ) -> None:
        if kind == "DELETED":
            self.resource_version = next(self._version)
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.resource_version)
        entry = Event(self.resource_version, resource, kind, copy.deepcopy(obj), copy.deepcopy(previous))
        self.history.append(entry)
        for queue in list(self._watchers):
            queue.put_nowait(entry)

    # -- HTTP -----------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        if self._failures:
            status = self._failures.pop(0)
            return _error(status, "InternalError", "injected failure")
        parts = [p for p in request.path.split("/") if p]
        if parts == ["version"]:
            return web.json_response(
                {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
            )
        if parts == ["api"]:
            return web.json_response(
                {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
            )
        if parts == ["apis"]:
            return web.json_response(self._group_list())
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return _error(404, "NotFound", f"the server could not find the requested resource {request.path}")
        if not rest:
            return self._resource_list(group, version)
        namespace = ""
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        resource = self.resources.get((group, version, rest[0]))
        if resource is None or len(rest) > 2:
            return _error(404, "NotFound", f"the server could not find the requested resource {request.path}")
        name = rest[1] if len(rest) == 2 else None
        query = {k: v[0] for k, v in parse_qs(request.query_string).items()}
        if name is None:
            if request.method == "GET":
                if query.get("watch") in _GO_TRUE:
                    return await self._watch(request, resource, namespace, query)
                return self._list(resource, namespace, query)
            if request.method == "POST":
                return await self._create(request, resource, namespace)
            return _error(405, "MethodNotAllowed", request.method)
        key = (resource, namespace, name)
        current = self.objects.get(key)
        if request.method == "GET":
            if current is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            return web.json_response(current)
        if request.method == "DELETE":
            if current is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            self.delete(resource.kind, namespace, name)
            return web.json_response(current)
        body = await request.json()
        if request.method == "PUT":
            if current is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                return _error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource.plural} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            body.setdefault("metadata", {}).update(name=name, namespace=namespace or None)
            if not namespace:
                body["metadata"].pop("namespace")
            return web.json_response(self._store(resource, key, body, "MODIFIED"))
        if request.method == "PATCH":
            if current is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            return web.json_response(
                self._store(resource, key, _merge(copy.deepcopy(current), body), "MODIFIED")
            )
        return _error(405, "MethodNotAllowed", request.method)

    def _group_list(self) -> dict[str, Any]:
        groups: dict[str, list[str]] = {}
        for r in self.resources.values():
            if r.group and r.version not in groups.setdefault(r.group, []):
                groups[r.group].append(r.version)
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in versions],
                    "preferredVersion": {"groupVersion": f"{g}/{versions[0]}", "version": versions[0]},
                }
                for g, versions in groups.items()
            ],
        }

    def _resource_list(self, group: str, version: str) -> web.Response:
        found = [r for r in self.resources.values() if (r.group, r.version) == (group, version)]
        if not found:
            return _error(404, "NotFound", f"no group version {group}/{version}")
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        return web.json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": found[0].api_version,
                "resources": [
                    {
                        "name": r.plural,
                        "singularName": r.kind.lower(),
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": verbs,
                    }
                    for r in found
                ],
            }
        )

    def _selected(self, resource: Resource, namespace: str, query: dict[str, str]) -> list[dict[str, Any]]:
        return [
            obj
            for (r, ns, _), obj in sorted(self.objects.items(), key=lambda item: item[0][1:])
            if r == resource
            and (not namespace or ns == namespace)
            and _matches(obj, query.get("labelSelector"), query.get("fieldSelector"))
        ]

    def _list(self, resource: Resource, namespace: str, query: dict[str, str]) -> web.Response:
        return web.json_response(
            {
                "apiVersion": resource.api_version,
                "kind": f"{resource.kind}List",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": self._selected(resource, namespace, query),
            }
        )

    async def _create(self, request: web.Request, resource: Resource, namespace: str) -> web.Response:
        body = await request.json()
        metadata = body.setdefault("metadata", {})
        name = metadata.get("name")
        if not name:
            return _error(422, "Invalid", "metadata.name: Required value")
        if namespace:
            metadata["namespace"] = namespace
        key = (resource, namespace, name)
        if key in self.objects:
            return _error(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
        return web.json_response(self._store(resource, key, body, "ADDED"), status=201)

    async def _expire(self, response: web.StreamResponse, since: int) -> None:
        self.expired_watches += 1
        message = f"too old resource version: {since} ({self.compacted})"
        await response.write(_line({"type": "ERROR", "object": _status(410, "Expired", message)}))

    async def _watch(
        self, request: web.Request, resource: Resource, namespace: str, query: dict[str, str]
    ) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or 0)
        timeout = float(query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since and since < self.compacted:
            await self._expire(response, since)
            return response
        queue: asyncio.Queue[Event | str | None] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            for entry in self.history:
                queue.put_nowait(entry)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (remaining := deadline - loop.time()) > 0:
                try:
                    entry = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if entry is None:
                    break
                if entry is EXPIRED:
                    await self._expire(response, since)
                    break
                assert isinstance(entry, Event)
                if entry.resource != resource or entry.version <= since:
                    continue
                if namespace and entry.obj["metadata"].get("namespace") != namespace:
                    continue
                kind = _seen_as(entry, query.get("labelSelector"), query.get("fieldSelector"))
                if kind is not None:
                    await response.write(_line({"type": kind, "object": entry.obj}))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(queue)
        return response


def _seen_as(event: Event, label_selector: str | None, field_selector: str | None) -> str | None:
    """The event type a selective watch sees: an object that starts or stops matching the
    selector is ADDED or DELETED for that watch, as the real server reports it."""
    now = event.kind != "DELETED" and _matches(event.obj, label_selector, field_selector)
    before = event.previous is not None and _matches(event.previous, label_selector, field_selector)
    if event.kind == "DELETED":
        return "DELETED" if before else None
    if now:
        return "MODIFIED" if before else "ADDED"
    return "DELETED" if before else None


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
    return target
