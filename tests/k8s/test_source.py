"""The Kubernetes endpoint source against a fake API server over real HTTP.

The API server is a fake (tests/k8s/fake_apiserver.py) because no real one can run here: no
cluster, no etcd. It speaks the real list/watch protocol (resourceVersions, line-delimited
watch events, 410 Expired ERROR events, Status bodies) with real-shaped objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.objectives import ObjectivePriorities
from epp.k8s.reflector import Backoff
from epp.k8s.source import ApiGroupVersion, KubernetesSource, PoolWatch
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.shapes import NAMESPACE, POOL, inference_objective, inference_pool, pod, set_ready
from tests.support import eventually

FAST = Backoff(initial_s=0.05, max_s=0.2)


class Running:
    def __init__(
        self, source: KubernetesSource, store: EndpointStore, priorities: ObjectivePriorities
    ) -> None:
        self.source, self.store, self.priorities = source, store, priorities

    def endpoints(self) -> dict[str, str]:
        return {s.endpoint.name: s.endpoint.hostport for s in self.store.all()}


@pytest.fixture
async def running(apiserver: FakeApiServer, kube_api: ApiClient) -> AsyncIterator[Running]:
    apiserver.put(inference_pool())
    apiserver.put(pod("vllm-0", "10.52.0.10"))
    apiserver.put(pod("vllm-1", "10.52.0.11"))
    apiserver.put(pod("vllm-2", "10.52.0.12", ready=False))
    apiserver.put(pod("unrelated", "10.52.0.99", labels={"app": "other"}))
    apiserver.put(inference_objective("batch", -1))
    store, priorities = EndpointStore(), ObjectivePriorities()
    objective_api = ApiGroupVersion.parse("inference.networking.x-k8s.io/v1alpha2")
    source = KubernetesSource(
        kube_api, PoolWatch(NAMESPACE, POOL, objective_api, backoff=FAST), store, priorities
    )
    task = asyncio.create_task(source.run())
    await asyncio.wait_for(source.synced.wait(), 5)
    yield Running(source, store, priorities)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_initial_sync_has_the_ready_matching_pods(running: Running) -> None:
    assert running.endpoints() == {"vllm-0": "10.52.0.10:8000", "vllm-1": "10.52.0.11:8000"}
    await eventually(lambda: running.priorities == {"batch": -1}, what="objective priorities")


async def test_pod_churn(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.put(pod("vllm-3", "10.52.0.13"))
    apiserver.delete("Pod", NAMESPACE, "vllm-0")
    await eventually(lambda: set(running.endpoints()) == {"vllm-1", "vllm-3"}, what="churn")
    # A pod recreated under the same name with a new IP is a new endpoint.
    apiserver.put(pod("vllm-1", "10.52.0.21"))
    await eventually(lambda: running.endpoints().get("vllm-1") == "10.52.0.21:8000", what="new IP")


async def test_readiness_flips(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.put(set_ready(apiserver.get("Pod", NAMESPACE, "vllm-0"), False))
    apiserver.put(set_ready(apiserver.get("Pod", NAMESPACE, "vllm-2"), True))
    await eventually(lambda: set(running.endpoints()) == {"vllm-1", "vllm-2"}, what="flip")
    apiserver.put(set_ready(apiserver.get("Pod", NAMESPACE, "vllm-0"), True))
    await eventually(lambda: set(running.endpoints()) == {"vllm-0", "vllm-1", "vllm-2"}, what="flip back")


async def test_410_gone_relists(apiserver: FakeApiServer, running: Running) -> None:
    pods = running.source._pods
    assert pods is not None
    relists = pods.relists
    # The open watches are told their version expired (ERROR event, 410): they relist.
    await eventually(lambda: apiserver.open_watches == 3, what="pool, pod and objective watches")
    expired = apiserver.expired_watches
    apiserver.compact()
    apiserver.put(pod("vllm-4", "10.52.0.14"))
    await eventually(lambda: "vllm-4" in running.endpoints(), what="relist after 410")
    assert pods.relists == relists + 1
    assert apiserver.expired_watches >= expired + 3  # pool, pods and objectives


async def test_api_server_outage(
    apiserver: FakeApiServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    await apiserver.stop()
    # Evidence that reconnecting ran and failed: each of the three watches logs a failed relist.
    await eventually(
        lambda: sum("relisting in" in r.getMessage() for r in caplog.records) >= 3, what="failed relists"
    )
    assert set(running.endpoints()) == {"vllm-0", "vllm-1"}, "the last known pool stays while the API is down"
    apiserver.delete("Pod", NAMESPACE, "vllm-0")
    apiserver.put(pod("vllm-5", "10.52.0.15"))
    await apiserver.start()
    await eventually(lambda: set(running.endpoints()) == {"vllm-1", "vllm-5"}, what="recovery")


async def test_api_errors_back_off_and_recover(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.fail_requests(4, status=500)
    apiserver.compact()  # forces new list and watch requests, which hit the 500s
    apiserver.put(pod("vllm-6", "10.52.0.16"))
    await eventually(lambda: "vllm-6" in running.endpoints(), what="recovery after 500s")
    assert apiserver.failures_left == 0


async def test_pool_selector_change(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.put(pod("canary-0", "10.52.1.10", labels={"app": "canary"}))
    apiserver.put(inference_pool(match_labels={"app": "canary"}, ports=(8000, 8001)))
    await eventually(
        lambda: set(running.endpoints()) == {"canary-0-rank-0", "canary-0-rank-1"}, what="new pool"
    )
    apiserver.put(pod("canary-1", "10.52.1.11", labels={"app": "canary"}))
    await eventually(lambda: len(running.endpoints()) == 4, what="pods of the new selector")


async def test_pool_deleted_and_recreated(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.delete("InferencePool", NAMESPACE, POOL)
    await eventually(lambda: running.endpoints() == {}, what="empty pool")
    apiserver.put(inference_pool())
    await eventually(lambda: set(running.endpoints()) == {"vllm-0", "vllm-1"}, what="pool back")


async def test_objective_changes(apiserver: FakeApiServer, running: Running) -> None:
    apiserver.put(inference_objective("chat", 5))
    apiserver.put(inference_objective("batch", 0))
    await eventually(lambda: running.priorities == {"batch": 0, "chat": 5}, what="objectives")
    apiserver.delete("InferenceObjective", NAMESPACE, "chat")
    await eventually(lambda: running.priorities == {"batch": 0}, what="objective deleted")
