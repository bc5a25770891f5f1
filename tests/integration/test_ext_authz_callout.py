"""The ext_authz callout through real Envoy: one HTTP check routes each request, the access log
(with the Lua filter's first-token time and event count) finishes it, and refusals reach the
client as the EPP wrote them. Cancelled streams: ``test_response_metering``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from epp.extauthz.check import CheckAnswer
from epp.extauthz.server import serve
from epp.extproc.access_log import AccessLogReceiver
from epp.extproc.access_log import add_to_server as add_access_log_to_server
from epp.extproc.messages import DESTINATION_HEADER
from sim.envoy_admin import stat
from sim.envoy_config import gateway_bootstrap, write_cluster_endpoints
from sim.processes import free_port, start_envoy
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


async def test_the_gateways_lua_filter_counts_events_split_across_chunks(tmp_path: Path) -> None:
    """An answer written a few bytes at a time: its first body byte is marked, and its JSON
    events are counted once each however the chunks cut them (``[DONE]`` is not one)."""
    events = [b'data: {"choices":[{"text":"%d"}]}\n\n' % i for i in range(25)] + [b"data: [DONE]\n\n"]
    body = b"".join(events)

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(v)
            for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        for start in range(0, len(body), 5):  # cuts through "data: {" and "[DONE]" alike
            writer.write(body[start : start + 5])
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.close()

    entries: list = []
    upstream = await asyncio.start_server(engine, "127.0.0.1", 0)
    target = f"127.0.0.1:{upstream.sockets[0].getsockname()[1]}"

    async def answer(check):  # type: ignore[no-untyped-def]
        return CheckAnswer(200, {DESTINATION_HEADER: target, "x-request-id": "counted"})

    logs = grpc.aio.server()
    add_access_log_to_server(AccessLogReceiver(entries.append), logs)
    grpc_port = logs.add_insecure_port("127.0.0.1:0")
    await logs.start()
    checks = await serve(answer, lambda: True, "127.0.0.1", 0)
    gateway = free_port()
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [tuple(target.split(":"))])  # type: ignore[list-item]
    bootstrap = gateway_bootstrap(
        listen_port=gateway,
        epp_address=("127.0.0.1", grpc_port),
        endpoints_file=endpoints,
        ext_authz_port=checks.sockets[0].getsockname()[1],
    )
    envoy = await asyncio.to_thread(start_envoy, "gateway", bootstrap, tmp_path)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                f"http://127.0.0.1:{gateway}/v1/completions",
                json={"model": "tiny", "prompt": "hi", "stream": True},
            )
        assert response.content == body
        for _ in range(100):
            if entries:
                break
            await asyncio.sleep(0.05)
        [entry] = entries
        assert entry.request_id == "counted" and entry.ended == "complete"
        assert entry.sse_events == 25
        assert entry.first_body_byte_s is not None and 0 <= entry.first_body_byte_s < 1
    finally:
        envoy.stop()
        checks.close()
        upstream.close()
        await logs.stop(0)
