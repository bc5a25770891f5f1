"""Active-passive leader election on a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Every replica runs an elector. Each ``retry_s`` it reads the Lease:

* no Lease: create it naming itself (a 409 means another replica was first);
* its own: renew ``renewTime``; if it cannot renew for ``renew_deadline_s`` it steps down;
* another holder's: take over only once the record has not changed for
  ``lease_duration_s`` *as observed locally* (clock skew between pods does not matter).

Writes carry the ``resourceVersion`` they read, so two replicas racing for one Lease cannot
both win: the loser gets 409 Conflict. On shutdown a leader releases the Lease so a standby
takes over at its next retry instead of after a full lease duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, CoordinationV1Api
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

OnChange = Callable[[bool], Awaitable[None]]


def _micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """The Lease to campaign for, this replica's name in it, and client-go's timings."""

    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need retry_s < renew_deadline_s < lease_duration_s")


class LeaseElector:
    def __init__(
        self,
        api: ApiClient,
        lease: LeaseSettings,
        on_change: OnChange,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = CoordinationV1Api(api)
        self.namespace = lease.namespace
        self.name = lease.name
        self.identity = lease.identity
        self.on_change = on_change
        self.lease_duration_s = lease.lease_duration_s
        self.renew_deadline_s = lease.renew_deadline_s
        self.retry_s = lease.retry_s
        self.clock = clock
        self.leading = False
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0

    async def run(self) -> None:
        """Campaign (and lead) until cancelled; then release the Lease if held."""
        try:
            while True:
                try:
                    held = await self._try_acquire_or_renew()
                except (ApiException, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                    held = False
                now = self.clock()
                if held:
                    self._last_renew = now
                    await self._set_leading(True)
                elif self.leading and now - self._last_renew >= self.renew_deadline_s:
                    log.warning("%s could not renew lease %s: stepping down", self.identity, self.name)
                    await self._set_leading(False)
                await asyncio.sleep(self.retry_s)
        finally:
            if self.leading:
                await asyncio.shield(self._release())

    async def _set_leading(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info(
                "%s %s leader (lease %s/%s)",
                self.identity,
                "is now" if leading else "is no longer",
                self.namespace,
                self.name,
            )
            await self.on_change(leading)

    async def _read(self) -> dict[str, Any] | None:
        response = await self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
        try:
            body = await response.read()
            if response.status == 404:
                return None
            if response.status != 200:
                raise ApiException(status=response.status, reason=body[:200].decode(errors="replace"))
            return json.loads(body)
        finally:
            response.release()

    def _spec(self, transitions: int, acquire_time: str | None) -> dict[str, Any]:
        now = _micro_time(datetime.now(UTC))
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration_s)),
            "acquireTime": acquire_time or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def _try_acquire_or_renew(self) -> bool:
        lease = await self._read()
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0, None),
            }
            return await self._write(
                self._api.create_namespaced_lease(self.namespace, body, _preload_content=False)
            )
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        if holder and holder != self.identity:
            duration = spec.get("leaseDurationSeconds") or self.lease_duration_s
            if now - self._observed_at < duration:
                return False
            log.info("lease %s held by %s expired: taking over", self.name, holder)
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            lease["spec"] = self._spec(transitions, spec.get("acquireTime"))
        else:
            lease["spec"] = self._spec(transitions + 1, None)
        return await self._write(
            self._api.replace_namespaced_lease(self.name, self.namespace, lease, _preload_content=False)
        )

    async def _write(self, call: Awaitable[Any]) -> bool:
        response = await call
        try:
            body = await response.read()
            if response.status == 409:
                return False  # another replica wrote first; read again next round
            if response.status not in (200, 201):
                raise ApiException(status=response.status, reason=body[:200].decode(errors="replace"))
            return True
        finally:
            response.release()

    async def _release(self) -> None:
        try:
            lease = await self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = None
            await self._write(
                self._api.replace_namespaced_lease(self.name, self.namespace, lease, _preload_content=False)
            )
            log.info("%s released lease %s", self.identity, self.name)
        except (ApiException, aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("could not release lease %s: %s", self.name, exc)
        finally:
            self.leading = False
