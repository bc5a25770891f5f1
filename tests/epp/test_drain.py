"""A draining EPP: not ready from the moment it starts draining (even if it wins the Lease again),
alive, and still taking ext_proc connections until it stops."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.app import EXT_PROC_SERVICE, EppApp
from tests.epp.factories import local_epp_settings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def statuses(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            s: (await stub.Check(health_pb2.HealthCheckRequest(service=s))).status
            for s in ("liveness", "readiness", EXT_PROC_SERVICE)
        }


async def test_a_draining_epp_is_live_not_ready_and_still_takes_ext_proc_connections(tmp_path: Path) -> None:
    app = EppApp(local_epp_settings(tmp_path))
    await app.start()
    try:
        assert set((await statuses(app.health_port)).values()) == {SERVING}
        await app.begin_drain()
        await app._set_ready(True)  # as a leader election won while draining would
        assert await statuses(app.health_port) == {
            "liveness": SERVING,
            "readiness": NOT_SERVING,
            EXT_PROC_SERVICE: NOT_SERVING,
        }
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            await channel.channel_ready()
    finally:
        await app.stop()
