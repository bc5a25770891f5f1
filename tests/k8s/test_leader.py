"""Lease-based leader election against the fake API server (no real one can run here)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio.client import ApiClient

from epp.k8s.leader import LeaseElector, LeaseSettings
from tests.k8s.fake_apiserver import FakeApiServer
from tests.support import eventually

LEASE = "pool-epp-leader"


def lease_reads(apiserver: FakeApiServer) -> int:
    """How many times any elector has read the Lease: one per elector per round."""
    return sum(
        method == "GET" and path.partition("?")[0].endswith(f"/leases/{LEASE}")
        for method, path in apiserver.requests
    )


def elector(api: ApiClient, identity: str, log: list[tuple[str, bool]]) -> LeaseElector:
    async def on_change(leading: bool) -> None:
        log.append((identity, leading))

    lease = LeaseSettings(
        "default", LEASE, identity, lease_duration_s=1.0, renew_deadline_s=0.6, retry_s=0.05
    )
    return LeaseElector(api, lease, on_change)


async def test_one_leader_and_fast_handover_on_release(apiserver: FakeApiServer, kube_api: ApiClient) -> None:
    log: list[tuple[str, bool]] = []
    a, b = elector(kube_api, "a", log), elector(kube_api, "b", log)
    tasks = {e.identity: asyncio.create_task(e.run()) for e in (a, b)}
    await eventually(lambda: a.leading or b.leading, what="a leader")
    rounds = lease_reads(apiserver)
    await eventually(lambda: lease_reads(apiserver) >= rounds + 10, what="five more rounds of both")
    assert [a.leading, b.leading].count(True) == 1
    leader, follower = (a, b) if a.leading else (b, a)
    lease = apiserver.get("Lease", "default", LEASE)
    assert lease is not None and lease["spec"]["holderIdentity"] == leader.identity

    tasks[leader.identity].cancel()
    await asyncio.gather(tasks[leader.identity], return_exceptions=True)
    # Released on shutdown: the standby takes over within a few retries, not a lease duration.
    await eventually(lambda: follower.leading, timeout_s=0.5, what="handover")
    assert log == [(leader.identity, True), (follower.identity, True)]
    tasks[follower.identity].cancel()
    await asyncio.gather(tasks[follower.identity], return_exceptions=True)


async def test_takes_over_an_expired_lease(apiserver: FakeApiServer, kube_api: ApiClient) -> None:
    apiserver.put(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": LEASE, "namespace": "default"},
            "spec": {
                "holderIdentity": "crashed-replica",
                "leaseDurationSeconds": 1,
                "acquireTime": "2026-01-10T09:00:00.000000Z",
                "renewTime": "2026-01-10T09:00:00.000000Z",
                "leaseTransitions": 3,
            },
        }
    )
    log: list[tuple[str, bool]] = []
    c = elector(kube_api, "c", log)
    task = asyncio.create_task(c.run())
    await eventually(lambda: lease_reads(apiserver) >= 5, what="five reads of the held lease")
    assert not c.leading, "a lease is honoured for its duration as observed locally"
    assert apiserver.get("Lease", "default", LEASE)["spec"]["holderIdentity"] == "crashed-replica"
    await eventually(lambda: c.leading, timeout_s=2.0, what="takeover")
    lease = apiserver.get("Lease", "default", LEASE)
    assert lease is not None
    assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == ("c", 4)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_steps_down_when_it_cannot_renew(apiserver: FakeApiServer, kube_api: ApiClient) -> None:
    log: list[tuple[str, bool]] = []
    d = elector(kube_api, "d", log)
    task = asyncio.create_task(d.run())
    await eventually(lambda: d.leading, what="leading")
    await apiserver.stop()
    await eventually(lambda: not d.leading, timeout_s=2.0, what="step down")
    assert log == [("d", True), ("d", False)]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_timings_must_leave_room_to_renew_before_the_lease_expires() -> None:
    with pytest.raises(ValueError, match="retry_s < renew_deadline_s < lease_duration_s"):
        LeaseSettings("default", LEASE, "e", lease_duration_s=1.0, renew_deadline_s=1.0, retry_s=0.05)
