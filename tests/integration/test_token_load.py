"""Token-load accounting and token-load routing through a real Envoy, EPP and simulated replicas."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from epp.datalayer.metrics import TOKEN_LOAD_GAUGES
from sim.envoy_admin import stat
from sim.envoy_config import MODEL_SERVERS_CLUSTER
from sim.stack import LocalStack
from tests.stacks import start_stack
from tests.support import metric_sum, scrape, wait_for

pytestmark = pytest.mark.integration

REPLICAS = 3
LOAD_GAUGES = (*TOKEN_LOAD_GAUGES, "llm_epp_endpoint_in_flight_requests")


def endpoint_loads(stack: LocalStack) -> dict[str, float]:
    """Every per-endpoint load gauge the EPP exports, by ``name{labels}``."""
    return {f"{s.name}{s.labels}": s.value for s in scrape(stack.epp_metrics_url) if s.name in LOAD_GAUGES}


def completion(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def streamed(client: httpx.Client, url: str, body: dict, keep_chunks: int | None) -> None:
    """Stream a completion; stop reading (and close the connection) after ``keep_chunks`` chunks."""
    with client.stream("POST", url, json=body) as response:
        for n, _ in enumerate(response.iter_lines()):
            if keep_chunks is not None and n >= keep_chunks:
                return


def one_request(stack: LocalStack, i: int) -> str:
    """Request ``i`` of the soak: completes, is cancelled mid-stream or before any byte, or is
    non-streaming. Returns how it ended."""
    url = f"{stack.gateway_url}/v1/completions"
    prompt = f"request {i}: " + "tell me a long story about routers " * (5 + i % 7)
    kind = i % 4
    try:
        if kind == 0:
            with httpx.Client(timeout=30) as client:
                streamed(client, url, completion(prompt, 24, True), None)
            return "completed"
        if kind == 1:
            with httpx.Client(timeout=30) as client:
                streamed(client, url, completion(prompt, 400, True), 3)
            return "cancelled-mid-stream"
        if kind == 2:
            httpx.post(url, json=completion(prompt, 8, False), timeout=30)
            return "non-streaming"
        with httpx.Client(timeout=0.02) as client:
            streamed(client, url, completion(prompt, 400, True), None)
        return "completed"
    except httpx.TimeoutException:
        return "cancelled-early"
    except httpx.HTTPError:
        return "failed"


def test_token_load_returns_to_zero_after_cancellations_and_a_replica_kill(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=REPLICAS, epp_config="ray-kv-aware")
    try:
        url = f"{stack.gateway_url}/v1/completions"
        outcomes: Counter[str] = Counter()
        # Long streams that are open on every replica when one of them is killed.
        long_streams = []
        for i in range(2 * REPLICAS):
            body = completion(f"long {i} " + "once upon a time " * 20, 1500, True)
            t = threading.Thread(target=lambda b=body: outcomes.update([_long_stream(url, b)]), daemon=True)
            t.start()
            long_streams.append(t)
        assert wait_for(lambda: sum(_decode_tokens(stack).values()) > 0, timeout=10), endpoint_loads(stack)
        with ThreadPoolExecutor(max_workers=8) as pool:
            first = list(pool.map(lambda i: one_request(stack, i), range(40)))
            stack.replicas[REPLICAS - 1].stop(signal.SIGKILL)
            second = list(pool.map(lambda i: one_request(stack, i), range(40, 80)))
        outcomes.update(first + second)
        for t in long_streams:
            t.join(timeout=60)
        print(f"soak outcomes: {dict(outcomes)}")
        assert outcomes["cancelled-mid-stream"] >= 10 and outcomes["completed"] >= 10, outcomes
        assert outcomes["cancelled-early"] >= 1 and outcomes["killed"] >= 1, outcomes

        def drained() -> bool:
            loads = endpoint_loads(stack)
            return len(loads) == len(LOAD_GAUGES) * REPLICAS and not any(loads.values())

        assert wait_for(drained, timeout=15), _undrained(stack)
        assert stack.epp.alive()
    finally:
        stack.stop()


def _undrained(stack: LocalStack) -> str:
    """What keeps the loads from draining: how many gauges there are, and those not at zero."""
    loads = endpoint_loads(stack)
    left = {name: value for name, value in loads.items() if value}
    return f"{len(loads)} of {len(LOAD_GAUGES) * REPLICAS} gauges; not at zero: {left}"


def _long_stream(url: str, body: dict) -> str:
    try:
        with httpx.Client(timeout=60) as client:
            streamed(client, url, body, None)
        return "long-completed"
    except httpx.HTTPError:
        return "killed"


def _decode_tokens(stack: LocalStack) -> dict[str, float]:
    return {
        f"replica-{i}": metric_sum(
            stack.epp_metrics_url, "llm_epp_endpoint_decode_tokens_in_flight", model_server_pod=f"replica-{i}"
        )
        for i in range(REPLICAS)
    }


SYSTEM_PROMPT = "You are a meticulous assistant for a fleet of routers. " * 60


def routed_to(gateway_url: str, session: int) -> str:
    body = completion(f"{SYSTEM_PROMPT}\nUser {session}: summarise item {session}.", 48, True)
    headers = {"x-llm-epp-debug": "true", "x-session-id": f"session-{session}"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{gateway_url}/v1/completions", json=body, headers=headers) as response,
    ):
        for _ in response.iter_lines():
            pass
        assert response.status_code == 200
        return response.headers["x-llm-epp-endpoint"]


@pytest.mark.parametrize(("config", "piles_up"), [("ray-kv-aware", False), ("kv-affinity", True)])
def test_shared_prompt_burst_spreads_under_token_load_and_piles_up_under_kv_affinity(
    tmp_path: Path, config: str, piles_up: bool
) -> None:
    """The policies alone decide here: a scrape may take GIE's 2 s staleness before it takes a
    replica out of scheduling (the default 0.5 s is for stalls, and a loaded machine can delay a
    busy replica's scrape that long), and the gateway's retries are counted, since either would
    move the pile's prefix to a second replica."""
    stack = start_stack(tmp_path, replicas=REPLICAS, epp_config=config, epp_args=["--scrape-timeout-s", "2"])
    try:
        sessions = 24
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=sessions) as pool:
            counts = Counter(pool.map(lambda s: routed_to(stack.gateway_url, s), range(sessions)))
        elapsed = time.monotonic() - started
        print(f"{config}: per-replica requests {dict(sorted(counts.items()))} in {elapsed:.2f}s")
        retried = stat(stack.config.ports.envoy_admin, f"cluster.{MODEL_SERVERS_CLUSTER}.upstream_rq_retry")
        unhealthy = [line for line in stack.epp.log_path.read_text().splitlines() if "unhealthy" in line]
        why = (counts, f"{retried:.0f} retried", unhealthy)
        if piles_up:
            assert counts.most_common(1)[0][1] == sessions, why
        else:
            assert len(counts) == REPLICAS and counts.most_common(1)[0][1] <= sessions // 2, why
    finally:
        stack.stop()
