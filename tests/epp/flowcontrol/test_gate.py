"""The asyncio gate: requests wait, are released by finishes and expiries, and leave on hang-up."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from epp.errors import RequestShed
from epp.flowcontrol.config import build_flow_control
from epp.flowcontrol.gate import FlowGate, FlowTicket
from epp.flowcontrol.metrics import FlowMetrics
from epp.load.peer_totals import PeerTotals
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.types import ApiKind, LLMRequest
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from tests.epp.factories import endpoint_state
from tests.epp.sync_replicas import EppReplica

# One endpoint with room for 1000 booked tokens: one 600-token request saturates it.
CONFIG = """
plugins:
- type: queue-scorer
- type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: 1000}
flowControl:
  saturationDetectors: [token-load-saturation-detector]
  defaultOutputTokens: 100
  pollIntervalMs: 5
  retryAfterSeconds: 2
  bands:
  - {priority: -1, ttlSeconds: 0.2}
"""


def make_gate() -> tuple[FlowGate, CollectorRegistry]:
    context = PluginContext(clock=time.monotonic)
    config = EndpointPickerConfig.from_yaml(CONFIG)
    flow_control = build_flow_control(config, build_pipeline(config, context), context)
    assert flow_control is not None
    registry = CollectorRegistry()
    metrics = FlowMetrics(registry, "pool", flow_control.controller)
    endpoint = endpoint_state(0)
    endpoint.metrics.updated_at = time.monotonic()
    return FlowGate(flow_control, lambda: [endpoint], time.monotonic, metrics), registry


def llm_request(priority: int = 0, tenant: str = "t") -> LLMRequest:
    return LLMRequest(
        "r",
        "m",
        ApiKind.CHAT,
        [1] * 500,
        priority=priority,
        headers={"x-gateway-inference-fairness-id": tenant},
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"inference_pool": "pool", **labels}) or 0.0


async def until(condition) -> None:
    """Let the event loop run until ``condition()`` holds (each test's own timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.001)


async def wait(gate: FlowGate, request: LLMRequest) -> FlowTicket:
    """Admit ``request`` and wait for its ticket, as the director does."""
    return await gate.admit(request, time.monotonic()).ticket()


async def occupy(gate: FlowGate) -> FlowTicket:
    """Dispatch one request into the idle pool and route it, which saturates the pool."""
    ticket = await wait(gate, llm_request())
    ticket.routed("e0", CycleState(), time.monotonic())
    return ticket


async def test_waiters_are_released_in_band_order_as_requests_finish():
    gate, registry = make_gate()
    running = await occupy(gate)
    order: list[int] = []
    tickets: dict[int, FlowTicket] = {}

    async def waiter(band: int) -> None:
        tickets[band] = await wait(gate, llm_request(priority=band))
        order.append(band)

    tasks = [asyncio.create_task(waiter(band)) for band in (0, 1, 3)]
    await until(lambda: len(gate.controller) == 3)
    assert sample(registry, "inference_extension_flow_control_queue_size", priority="3", fairness_id="t") == 1
    assert sample(registry, "inference_extension_flow_control_pool_saturated") == 1
    running.finished()
    for band in (3, 1, 0):
        await until(lambda band=band: order[-1:] == [band])
        assert len(gate.controller) == {3: 2, 1: 1, 0: 0}[band]
        tickets[band].finished()
    await asyncio.gather(*tasks)
    assert order == [3, 1, 0]
    dispatched = {"fairness_id": "t", "outcome": "dispatched"}
    assert (
        sample(registry, "inference_extension_flow_control_requests_total", priority="0", **dispatched) == 2
    )
    assert sample(registry, "inference_extension_flow_control_pool_saturated") == 0


async def test_an_expired_request_is_shed_with_retry_after():
    gate, registry = make_gate()
    await occupy(gate)
    with pytest.raises(RequestShed) as shed:
        await wait(gate, llm_request(priority=-1))
    assert shed.value.status == 429 and shed.value.headers()["retry-after"] == "2"
    assert "time limit" in shed.value.message
    assert len(gate.controller) == 0
    expired = {"priority": "-1", "fairness_id": "t", "outcome": "expired"}
    assert sample(registry, "inference_extension_flow_control_requests_total", **expired) == 1
    assert (
        sample(registry, "inference_extension_flow_control_request_queue_duration_seconds_sum", **expired)
        >= 0.2
    )
    await gate.close()


async def test_a_waiter_that_is_cancelled_leaves_the_queue_and_the_metrics():
    gate, registry = make_gate()
    await occupy(gate)
    task = asyncio.create_task(wait(gate, llm_request(tenant="gone")))
    await until(lambda: len(gate.controller) == 1)
    size = {"priority": "0", "fairness_id": "gone"}
    assert sample(registry, "inference_extension_flow_control_queue_size", **size) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(gate.controller) == 0
    assert sample(registry, "inference_extension_flow_control_queue_size", **size) == 0
    cancelled = {**size, "outcome": "cancelled"}
    assert sample(registry, "inference_extension_flow_control_requests_total", **cancelled) == 1
    await gate.close()


async def test_a_peers_release_wakes_the_dispatcher_without_waiting_for_its_poll():
    """The poll interval is 10 minutes and nothing expires for an hour: only the event of the
    peer's release can dispatch the waiter before the test's timeout."""
    config = EndpointPickerConfig.from_yaml(
        CONFIG.replace("pollIntervalMs: 5", "pollIntervalMs: 600000").replace(
            "ttlSeconds: 0.2", "ttlSeconds: 3600"
        )
        + "  defaultBand: {ttlSeconds: 3600}\n"
    )
    context = PluginContext(clock=time.monotonic)
    flow_control = build_flow_control(config, build_pipeline(config, context), context)
    assert flow_control is not None
    endpoint = endpoint_state(0)
    gate = FlowGate(flow_control, lambda: [endpoint], time.monotonic)
    tuning = SyncTuning(peer_timeout_s=3600)
    ours = EppReplica(
        ReplicaSyncState("a", SyncTargets(token_load=PeerTotals()), clock=time.monotonic, tuning=tuning)
    )
    peer = EppReplica(
        ReplicaSyncState("b", SyncTargets(token_load=PeerTotals()), clock=time.monotonic, tuning=tuning)
    )
    gate.share_load(ours.sync)
    key = peer.route("e0", prompt=700, cached=0, expected=100)  # 800 of e0's 1000 tokens
    for data in peer.sync.take_messages():
        ours.sync.receive(data)
    waiter = asyncio.create_task(wait(gate, llm_request()))  # 600 tokens: no room
    await until(lambda: len(gate.controller) == 1)
    await asyncio.sleep(0)  # the dispatcher is waiting for its wake-up
    assert not waiter.done()
    peer.release(key)
    for data in peer.sync.take_messages():
        ours.sync.receive(data)
    ticket = await asyncio.wait_for(waiter, timeout=30)
    assert len(gate.controller) == 0 and gate.controller.booked() == 1
    ticket.finished()
    await gate.close()


async def test_a_held_request_calls_on_queued_and_one_dispatched_at_once_does_not():
    """The EPP asks for fresh scrapes of every endpoint then (idle ones are scraped slowly)."""
    gate, _ = make_gate()
    holds: list[float] = []
    gate.on_queued = lambda: holds.append(time.monotonic())
    running = await occupy(gate)
    assert holds == []
    waiter = asyncio.create_task(wait(gate, llm_request()))
    await until(lambda: len(gate.controller) == 1)
    assert len(holds) == 1
    running.finished()
    (await waiter).finished()


async def test_an_admission_says_whether_it_is_held_and_one_withdrawn_leaves_the_queue():
    """A held request's admission says its band's TTL (the ext_proc stream extends Envoy's
    timeout by it); one dispatched at once says nothing. A driver that gives up on a held
    request before awaiting its ticket withdraws it."""
    gate, registry = make_gate()
    at_once = gate.admit(llm_request(), time.monotonic())
    assert at_once.held_s is None
    (await at_once.ticket()).routed("e0", CycleState(), time.monotonic())
    held = gate.admit(llm_request(priority=-1, tenant="gone"), time.monotonic())
    assert held.held_s == 0.2 and len(gate.controller) == 1
    held.withdraw()
    held.withdraw()  # idempotent
    assert len(gate.controller) == 0
    cancelled = {"priority": "-1", "fairness_id": "gone", "outcome": "cancelled"}
    assert sample(registry, "inference_extension_flow_control_requests_total", **cancelled) == 1
    await gate.close()
