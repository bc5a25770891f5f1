"""A local cache of one kind of Kubernetes object, kept current with list + watch.

The protocol is the API server's own: ``LIST`` returns the objects and a ``resourceVersion``;
``WATCH`` from that version streams one JSON event per line (``ADDED``, ``MODIFIED``,
``DELETED``, ``BOOKMARK``, ``ERROR``). The reflector

* re-watches from the last version it saw when a watch ends (server-side timeout),
* relists at once when the version is too old (``410 Gone``, as an HTTP status or an
  ``ERROR`` event),
* relists with exponential backoff and jitter after any other failure (API server down,
  connection reset, 5xx, a garbled line), and
* relists every ``resync_s`` anyway, so a missed event cannot linger.

Requests go through the ``kubernetes_asyncio`` client (authentication, TLS, URLs); the
responses are read raw, so the cache holds the JSON objects exactly as the server sent them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

KubeObject = dict[str, Any]


class RawResponse(Protocol):
    """What ``kubernetes_asyncio`` returns with ``_preload_content=False`` (an aiohttp response)."""

    status: int
    content: aiohttp.StreamReader

    async def read(self) -> bytes: ...

    def release(self) -> Any: ...


ListCall = Callable[..., Awaitable[RawResponse]]
"""A bound ``kubernetes_asyncio`` list method with its path arguments and selectors applied,
e.g. ``functools.partial(core.list_namespaced_pod, "ns", label_selector="app=x")``."""


class Gone(Exception):
    """The watched ``resourceVersion`` is too old (410): the cache must be rebuilt by a list."""


class WatchFailed(Exception):
    """The API server answered an error, or a line that is not a watch event."""


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * self.factor**attempt)
        return base * (1 + self.jitter * (2 * rng.random() - 1))


def object_key(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


class Reflector:
    """Keeps :attr:`objects` equal to the server's objects of one list call.

    ``on_change`` runs (synchronously, on the event loop) after every list and after every
    watch event that changed the cache. :attr:`synced` is set once the first list succeeded.
    """

    def __init__(
        self,
        name: str,
        list_call: ListCall,
        on_change: Callable[[], None],
        *,
        resync_s: float = 300.0,
        watch_timeout_s: int = 240,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.list_call = list_call
        self.on_change = on_change
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self.rng = rng or random.Random()
        self.objects: dict[str, KubeObject] = {}
        self.resource_version: str | None = None
        self.synced = asyncio.Event()
        self.relists = 0

    async def run(self) -> None:
        """List and watch until cancelled."""
        failures = 0
        while True:
            try:
                await self._list()
                failures = 0
                deadline = time.monotonic() + self.resync_s
                while time.monotonic() < deadline:
                    await self._watch(deadline - time.monotonic())
            except Gone:
                log.info(
                    "%s: resourceVersion %s expired (410 Gone); relisting", self.name, self.resource_version
                )
            except (ApiException, WatchFailed, aiohttp.ClientError, TimeoutError, OSError) as exc:
                delay = self.backoff.delay(failures, self.rng)
                failures += 1
                log.warning("%s: %s; relisting in %.1fs", self.name, _describe(exc), delay)
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        response = await self.list_call(_preload_content=False)
        try:
            body = await response.read()
            if response.status == 410:
                raise Gone()
            if response.status != 200:
                raise WatchFailed(f"list answered {response.status}: {body[:200]!r}")
            listed = json.loads(body)
        except ValueError as exc:
            raise WatchFailed(f"list answered invalid JSON: {exc}") from exc
        finally:
            response.release()
        self.objects = {object_key(obj): obj for obj in listed.get("items") or []}
        self.resource_version = (listed.get("metadata") or {}).get("resourceVersion")
        self.relists += 1
        self.synced.set()
        self.on_change()

    async def _watch(self, remaining_s: float) -> None:
        timeout = max(1, min(self.watch_timeout_s, int(remaining_s)))
        response = await self.list_call(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _preload_content=False,
            # The server closes the stream after ``timeout``; the margin catches a hung one.
            _request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=timeout + 30),
        )
        try:
            if response.status == 410:
                raise Gone()
            if response.status != 200:
                raise WatchFailed(f"watch answered {response.status}: {(await response.read())[:200]!r}")
            opened, events = time.monotonic(), 0
            while line := await response.content.readline():
                if line.strip():
                    events += 1
                    self._apply(line)
            if events == 0 and time.monotonic() - opened < 1.0:
                # A stream that closes at once, again and again, would spin: back off instead.
                raise WatchFailed("watch stream closed at once")
        finally:
            response.release()

    def _apply(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WatchFailed(f"invalid watch event {line[:200]!r}") from exc
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise WatchFailed(f"watch error event: {obj.get('code')} {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return
        key = object_key(obj)
        if kind in ("ADDED", "MODIFIED"):
            self.objects[key] = obj
        elif kind == "DELETED":
            self.objects.pop(key, None)
        else:
            raise WatchFailed(f"unknown watch event type {kind!r}")
        self.on_change()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"API error {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
