"""The ext_authz callout through real Envoy: one HTTP check routes each request, the access log
(with the Lua filter's first-token time and event count) finishes it, and refusals reach the
client as the EPP wrote them. Cancelled streams: ``test_response_metering``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from sim.envoy_admin import stat
from tests.integration.test_response_metering import answer, gauges
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration

MODEL_LABELS = {"model_name": "tiny", "target_model_name": "tiny"}


def test_requests_are_routed_by_the_check_and_finished_by_the_log(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", callout="ext-authz")
    try:
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
        lengths = [1, 16, 64, 300]
        for n in lengths:
            assert answer(client, n) == (n, "length", n)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert done.choices[0].finish_reason == "length"
        url = stack.epp_metrics_url
        assert wait_for(lambda: metric_sum(url, "llm_epp_access_log_entries_total", kind="final") == 5)
        assert metric_sum(url, "inference_objective_request_duration_seconds_count", **MODEL_LABELS) == 5
        assert metric_sum(url, "inference_objective_request_error_total") == 0
        # Every stream's first token came from its log entry, its tokens from the event count.
        assert metric_sum(url, "inference_objective_request_ttft_seconds_count", **MODEL_LABELS) == 4
        counted = metric_sum(url, "inference_objective_output_tokens_sum", **MODEL_LABELS)
        assert counted == sum(lengths)
        assert not any(gauges(url).values()), gauges(url)
        # One check per request, on kept-alive connections.
        admin = stack.config.ports.envoy_admin
        assert stat(admin, "http.gateway.ext_authz.ok") == 5
        assert stat(admin, "cluster.epp_ext_authz.upstream_cx_total") < 5
    finally:
        stack.stop()


def test_refusals_and_decision_traces_reach_the_client(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", callout="ext-authz")
    url = f"{stack.gateway_url}/v1/completions"
    try:
        with httpx.Client(timeout=30) as client:
            bad = client.post(
                url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
            )
            assert bad.status_code == 400
            assert bad.headers["content-type"] == "application/json"
            assert bad.json()["error"]["code"] == 400
            traced = client.post(
                url,
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                headers={"x-llm-epp-debug": "true"},
            )
            assert traced.status_code == 200
            assert traced.headers["x-llm-epp-endpoint"]  # the trace rode the check's answer
            # A client cannot pick its own endpoint, nor pose as another source.
            chosen = client.post(
                url,
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                headers={"x-gateway-destination-endpoint": "127.0.0.1:1", "x-llm-epp-source": "10.0.0.1"},
            )
            assert chosen.status_code == 200
        assert (
            metric_sum(stack.epp_metrics_url, "inference_objective_request_error_total", error_code="400")
            == 1
        )
    finally:
        stack.stop()


def test_two_synced_epps_share_the_checks_and_each_finishes_its_own(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", epp_replicas=2, callout="ext-authz")
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)

    try:
        epps = stack.epp_metrics_urls
        assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in epps))
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: answer(client, 30), range(12))) == [(30, "length", 30)] * 12
        served = [metric_sum(u, "inference_objective_request_total") for u in epps]
        assert sum(served) == 12 and min(served) >= 1, served  # Envoy spread the checks
        for url, own in zip(epps, served, strict=True):
            # Each replica gets the entries of the requests it routed, and no other.
            assert wait_for(
                lambda u=url, n=own: metric_sum(u, "llm_epp_access_log_entries_total", kind="final") == n
            )
            assert metric_sum(url, "llm_epp_access_log_entries_total", kind="unknown") == 0
            assert metric_sum(url, "inference_objective_output_tokens_sum", **MODEL_LABELS) == 30 * own
            assert wait_for(lambda u=url: not any(gauges(u).values())), gauges(url)
    finally:
        stack.stop()
