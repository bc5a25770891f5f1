"""Replica and EPP failures, each on a stack of its own."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration


def test_killed_replica_mid_stream(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, sim_profile="instant")
    try:
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=20_000, stream=True)
        chunks = iter(stream)
        next(chunks)
        running = [metric_sum(stack.replica_url(i) + "/metrics", "vllm:num_requests_running") for i in (0, 1)]
        victim = running.index(1.0)
        survivor = 1 - victim
        stack.replicas[victim].stop(signal.SIGKILL)
        # The client gets an error, not a hang and not a silently truncated success.
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in chunks:
                pass
        healthy = "llm_epp_endpoint_healthy"
        pod = f"replica-{victim}"
        assert wait_for(lambda: metric_sum(stack.epp_metrics_url, healthy, model_server_pod=pod) == 0)
        survivor_metrics = stack.replica_url(survivor) + "/metrics"
        served_before = metric_sum(survivor_metrics, "vllm:request_success_total")
        for _ in range(20):
            assert (
                client.completions.create(model="tiny", prompt="Hello", max_tokens=2).usage.completion_tokens
                == 2
            )
        assert metric_sum(survivor_metrics, "vllm:request_success_total") - served_before == 20
        assert stack.epp.alive()
    finally:
        stack.stop()


@pytest.mark.parametrize("callout", ["ext-proc", "ext-authz"])
@pytest.mark.parametrize(("mode", "served"), [("FailOpen", True), ("FailClose", False)])
def test_epp_down_follows_the_failure_mode(tmp_path: Path, mode: str, served: bool, callout: str) -> None:
    stack = start_stack(tmp_path, replicas=2, sim_profile="instant", failure_mode=mode, callout=callout)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=10).status_code == 200
        stack.epp.stop(signal.SIGKILL)
        responses = [
            httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=10) for _ in range(5)
        ]
        if served:
            assert [r.status_code for r in responses] == [200] * 5
        else:
            # Envoy's own error, in the OpenAI shape.
            assert {r.status_code for r in responses} == {500}
            assert {r.headers["content-type"] for r in responses} == {"application/json"}
            error = {"message": "the endpoint picker failed", "type": "InternalServerError", "param": None}
            assert all(r.json() == {"error": {**error, "code": 500}} for r in responses)
    finally:
        stack.stop()
