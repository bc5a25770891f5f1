"""The EPP process on the Kubernetes source: endpoints from the (fake) API server, readiness
only once synced and while holding the leader Lease. The API server is the in-process fake
(tests/k8s/fake_apiserver.py), since no real one can run here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.app import EXT_PROC_SERVICE, EppApp
from epp.settings import EppSettings
from sim.models import TINY_MODEL_DIR
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.shapes import NAMESPACE, POOL, inference_objective, inference_pool, pod
from tests.support import eventually


async def _status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service)
        )
        return reply.status


async def _until_serving(port: int, service: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while await _status(port, service) != health_pb2.HealthCheckResponse.SERVING:
        assert asyncio.get_running_loop().time() < deadline, f"{service} never became SERVING"
        await asyncio.sleep(0.02)


async def test_epp_serves_a_pool_from_kubernetes_with_leader_election(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(apiserver.kubeconfig()))
    settings = EppSettings(
        host="127.0.0.1",
        grpc_port=0,
        health_port=0,
        metrics_port=0,
        endpoint_source="kubernetes",
        kubeconfig=kubeconfig,
        pool_name=POOL,
        pool_namespace=NAMESPACE,
        ha_enable_leader_election=True,
        tokenizer_dir=TINY_MODEL_DIR,
    )
    app = EppApp(settings)
    await app.start()
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await _status(app.health_port, "liveness") == serving
        assert await _status(app.health_port, "readiness") != serving, "no pool yet"

        apiserver.put(inference_pool())
        apiserver.put(pod("vllm-0", "10.52.0.10"))
        apiserver.put(inference_objective("batch", -1))
        await eventually(lambda: [s.endpoint.hostport for s in app.store.all()] == ["10.52.0.10:8000"])
        for service in ("readiness", EXT_PROC_SERVICE):
            await _until_serving(app.health_port, service)
        lease = apiserver.get("Lease", NAMESPACE, f"{POOL}-epp-leader")
        assert lease is not None and lease["spec"]["holderIdentity"]
        await eventually(lambda: app.director.objective_priorities == {"batch": -1})
    finally:
        await app.stop()
    lease = apiserver.get("Lease", NAMESPACE, f"{POOL}-epp-leader")
    assert lease is not None and lease["spec"]["holderIdentity"] is None, "released on shutdown"
