"""The EPP process with replica sync on: it starts, is ready and stops whether NATS is there or not,
and its peers' bookings reach its metrics."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.app import EXT_PROC_SERVICE, EppApp
from epp.settings import EppSettings
from epp.sync.messages import DeltaKind, MessageKind, SyncMessage, encode
from sim.processes import free_port
from tests.epp.factories import local_epp_settings
from tests.epp.sync_replicas import Nats
from tests.support import eventually


def settings(tmp_path: Path, nats_url: str) -> EppSettings:
    return local_epp_settings(
        tmp_path,
        config="ray-kv-aware",
        sync_nats_url=[nats_url],
        replica_id="epp-a",
        sync_heartbeat_interval_s=0.1,
        sync_peer_timeout_s=0.5,
    )


async def serving(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE)
        )
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_without_nats_the_epp_still_starts_serves_and_stops(tmp_path: Path) -> None:
    app = EppApp(settings(tmp_path, f"nats://127.0.0.1:{free_port()}"))  # nobody listens there
    await app.start()
    try:
        assert await serving(app.health_port)
        assert app.registry.get_sample_value("llm_epp_sync_connected") == 0
    finally:
        started = time.monotonic()
        await app.stop()
        assert time.monotonic() - started < 5


@pytest.mark.integration
async def test_a_peers_booking_shows_in_the_epps_token_load_gauges(tmp_path: Path) -> None:
    server = Nats(tmp_path)
    server.start()
    app = EppApp(settings(tmp_path, server.url))
    await app.start()
    try:
        await eventually(lambda: app.registry.get_sample_value("llm_epp_sync_connected") == 1)
        peer = await nats.connect(server.url)
        totals = [DeltaKind.TOTALS, "replica-0", 1, 120, 0, 40, 300, None, b""]
        message = SyncMessage(MessageKind.DELTAS, "epp-b", 7, 1, time.time(), [totals])
        await peer.publish("llm-epp.local-pool.events", encode(message))
        await peer.flush()
        labels = {"name": "local-pool", "model_server_pod": "replica-0"}

        def gauge(name: str) -> float | None:
            return app.registry.get_sample_value(name, labels)

        await eventually(lambda: gauge("llm_epp_endpoint_prefill_tokens_in_flight") == 120)
        assert gauge("llm_epp_endpoint_kv_tokens_in_flight") == 300
        assert gauge("llm_epp_endpoint_remote_token_share") == 1.0
        assert app.registry.get_sample_value("llm_epp_sync_peers_alive") == 1
        await peer.close()  # epp-b goes silent: its booking expires
        await eventually(lambda: gauge("llm_epp_endpoint_kv_tokens_in_flight") == 0)
        assert gauge("llm_epp_endpoint_remote_token_share") == 0.0
    finally:
        await app.stop()
        server.stop()
