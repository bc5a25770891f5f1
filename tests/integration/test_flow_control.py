"""Flow control through a real Envoy, EPP and simulated replica: a saturated pool holds requests
and releases them in band order; a client that hangs up while queued leaves the queue and its
gauge; a request that waits past its band's TTL gets 429 with Retry-After, in the JSON error shape;
a request held longer than Envoy's ext_proc message timeout (5 s) still gets its answer or its 429
(the EPP extends Envoy's timer while it holds one).

The pool is one replica and a token-load detector with room for 60 booked tokens, so each
request (prompt plus ``max_tokens``, at least 40 tokens) saturates it alone: requests run one at
a time, and finish in the order flow control dispatched them. Two EPPs synced over NATS count
each other's token load: one holds a request because of what the other has in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration


def flow_config(default_ttl_s: float, sheddable_ttl_s: float) -> str:
    """Room for one request per endpoint; the default band and the sheddable one's TTLs."""
    return f"""
plugins:
- type: queue-scorer
- type: token-load-saturation-detector
  parameters: {{maxTokensPerEndpoint: 60}}
flowControl:
  saturationDetectors: [token-load-saturation-detector]
  retryAfterSeconds: 2
  defaultBand: {{ttlSeconds: {default_ttl_s}}}
  bands:
  - {{priority: -1, ttlSeconds: {sheddable_ttl_s}}}
"""


CONFIG = flow_config(4, 0.3)
QUEUE = "inference_extension_flow_control_queue_size"
LEFT = "inference_extension_flow_control_requests_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir: Path = tmp_path_factory.mktemp("flow-control")
    config = workdir / "flow-control.yaml"
    config.write_text(CONFIG)
    stack = start_stack(workdir, replicas=1, epp_config=str(config))
    try:
        yield stack
    finally:
        stack.stop()


def post(stack: LocalStack, max_tokens: int, priority: int = 0, timeout: float = 30.0) -> httpx.Response:
    body = {"model": "tiny", "prompt": "flow control", "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"x-llm-d-priority": str(priority), "x-gateway-inference-fairness-id": "tenant"}
    return httpx.post(f"{stack.gateway_url}/v1/completions", json=body, headers=headers, timeout=timeout)


def queued(stack: LocalStack) -> float:
    return metric_sum(stack.epp_metrics_url, QUEUE)


def left(stack: LocalStack, outcome: str) -> float:
    return metric_sum(stack.epp_metrics_url, LEFT, outcome=outcome)


def hold_the_pool(stack: LocalStack, max_tokens: int = 400) -> threading.Thread:
    """Start a request that keeps the pool saturated for ``max_tokens`` decode steps."""
    dispatched = left(stack, "dispatched")
    blocker = threading.Thread(target=post, args=(stack, max_tokens))
    blocker.start()
    assert wait_for(lambda: left(stack, "dispatched") > dispatched)
    return blocker


def test_a_client_that_hangs_up_while_queued_leaves_the_queue(stack: LocalStack) -> None:
    blocker = hold_the_pool(stack)
    outcome: list[str] = []

    def impatient() -> None:
        try:
            post(stack, 100, timeout=0.8)
            outcome.append("answered")
        except httpx.TimeoutException:
            outcome.append("gave up")

    client = threading.Thread(target=impatient)
    client.start()
    assert wait_for(lambda: queued(stack) == 1)
    client.join()
    assert outcome == ["gave up"]
    assert wait_for(lambda: left(stack, "cancelled") == 1)
    assert queued(stack) == 0
    blocker.join()


def test_a_request_that_waits_past_its_ttl_gets_429_with_retry_after(stack: LocalStack) -> None:
    blocker = hold_the_pool(stack)
    response = post(stack, 100, priority=-1)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert error["type"] == "TooManyRequestsError" and error["code"] == 429
    assert "time limit" in error["message"]
    assert left(stack, "expired") == 1 and queued(stack) == 0
    blocker.join()


def test_a_saturated_pool_dispatches_held_requests_in_band_order(stack: LocalStack) -> None:
    blocker = hold_the_pool(stack, max_tokens=500)
    finished: list[int] = []

    def request(priority: int) -> None:
        response = post(stack, 40, priority=priority)
        assert response.status_code == 200, response.text
        finished.append(priority)

    clients = []
    for n, priority in enumerate((0, 3, 5), start=1):  # lowest first: arrival order is not the order
        clients.append(threading.Thread(target=request, args=(priority,)))
        clients[-1].start()
        assert wait_for(lambda n=n: queued(stack) == n)
    blocker.join()
    for client in clients:
        client.join()
    assert finished == [5, 3, 0]
    assert queued(stack) == 0


LONG_HOLD_CONFIG = flow_config(30, 6)


def test_requests_held_past_envoys_message_timeout_are_answered_or_expire_with_429(tmp_path: Path) -> None:
    config = tmp_path / "long-hold.yaml"
    config.write_text(LONG_HOLD_CONFIG)
    stack = start_stack(tmp_path, replicas=1, epp_config=str(config))
    try:
        blocker = hold_the_pool(stack, max_tokens=1400)  # about 8 s of decode steps
        responses: dict[int, httpx.Response] = {}

        def request(priority: int) -> None:
            responses[priority] = post(stack, 40, priority=priority, timeout=60)

        clients = [threading.Thread(target=request, args=(priority,)) for priority in (0, -1)]
        held_since = time.monotonic()
        for n, client in enumerate(clients, start=1):
            client.start()
            assert wait_for(lambda n=n: queued(stack) == n)
        for client in clients:
            client.join()
        held_for = time.monotonic() - held_since
        expired = responses[-1]  # its 6 s TTL ran out while the blocker still ran
        assert expired.status_code == 429, expired.text
        assert expired.headers["retry-after"] == "2" and "time limit" in expired.json()["error"]["message"]
        answered = responses[0]  # dispatched when the blocker finished, past the 5 s message timeout
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["completion_tokens"] == 40
        assert held_for > 6  # both waited past Envoy's per-message timeout
        assert left(stack, "expired") == 1 and left(stack, "dispatched") == 2 and queued(stack) == 0
        blocker.join()
    finally:
        stack.stop()


POOL_WIDE_CONFIG = """
plugins:
- type: queue-scorer
- type: token-load-producer
- type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: 100}
flowControl:
  saturationDetectors: [token-load-saturation-detector]
"""


def test_a_synced_epp_holds_a_request_because_of_its_peers_load(tmp_path: Path) -> None:
    # Two EPPs share the pool's token load over NATS, so each has half of its 100 tokens to itself:
    # a 400-token request on one leaves the other no room for a 60-token one of its own.
    config = tmp_path / "pool-wide.yaml"
    config.write_text(POOL_WIDE_CONFIG)
    stack = start_stack(tmp_path, replicas=1, epp_config=str(config), epp_replicas=2)
    try:
        urls = stack.epp_metrics_urls
        assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in urls))
        blocker = threading.Thread(target=post, args=(stack, 400))
        blocker.start()
        assert wait_for(lambda: sum(metric_sum(u, LEFT, outcome="dispatched") for u in urls) == 1)
        holder = 0 if metric_sum(urls[0], LEFT, outcome="dispatched") else 1
        other = urls[1 - holder]
        assert wait_for(lambda: metric_sum(other, "llm_epp_endpoint_remote_token_share") > 0)
        clients: list[threading.Thread] = []
        statuses: list[int] = []
        # Envoy takes turns over the EPPs' streams; a request that lands on the holder waits too.
        while metric_sum(other, QUEUE) == 0 and len(clients) < 3:
            clients.append(threading.Thread(target=lambda: statuses.append(post(stack, 60).status_code)))
            clients[-1].start()
            n = len(clients)
            assert wait_for(lambda n=n: sum(metric_sum(u, QUEUE) for u in urls) == n)
        assert metric_sum(other, QUEUE) == 1
        assert metric_sum(other, LEFT, outcome="dispatched") == 0  # it had nothing of its own in flight
        blocker.join()
        for client in clients:
            client.join()
        assert statuses == [200] * len(clients)
        assert metric_sum(other, LEFT, outcome="dispatched") >= 1
        assert sum(metric_sum(u, QUEUE) for u in urls) == 0
    finally:
        stack.stop()
