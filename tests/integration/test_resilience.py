"""A replica that stalls or resets requests, and engines that close idle connections, fail no
request.

Each test runs its own stack: real Envoy, the EPP and simulated replicas. Clients never retry
(``max_retries=0``), so every failure the gateway lets through would show.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from sim.envoy_admin import stat
from sim.envoy_config import write_cluster_endpoints
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration

DEBUG = {"x-llm-epp-debug": "true"}  # the EPP names the endpoint it picked in the response


@dataclass
class Outcome:
    started: float
    endpoint: str | None = None
    error: str | None = None


def _streamed_completion(client: openai.OpenAI, max_tokens: int, prompt: str = "Tell me a story") -> Outcome:
    outcome = Outcome(time.monotonic())
    try:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, extra_headers=DEBUG
        )
        outcome.endpoint = raw.headers.get("x-llm-epp-endpoint")
        tokens = sum(1 for chunk in raw.parse() if chunk.choices and chunk.choices[0].text)
        if tokens != max_tokens:
            outcome.error = f"{tokens} of {max_tokens} tokens"
    except (openai.APIError, httpx.HTTPError) as exc:
        outcome.error = repr(exc)
    return outcome


def test_a_frozen_replica_fails_no_request_and_leaves_scheduling_within_a_second(tmp_path: Path) -> None:
    """300 streamed requests arrive at 25/s (about 8 in flight); one of three replicas is frozen
    (SIGSTOP) for 10 s from the 40th. Arrivals do not wait for answers, so requests stuck on the
    frozen replica do not stop new ones from arriving."""
    stack = start_stack(tmp_path, replicas=3, sim_profile="default")
    frozen = stack.replicas[0]
    requests, rate, freeze_s = 300, 25.0, 10.0
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        with ThreadPoolExecutor(max_workers=64) as pool:
            futures = []
            start = time.monotonic()
            for i in range(requests):
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
                if i == 40:
                    os.killpg(frozen.process.pid, signal.SIGSTOP)
                    frozen_at = time.monotonic()
                futures.append(pool.submit(_streamed_completion, client, 40))
            time.sleep(max(0.0, frozen_at + freeze_s - time.monotonic()))
            thawed_at = time.monotonic()
            os.killpg(frozen.process.pid, signal.SIGCONT)
            outcomes = [f.result() for f in futures]
    finally:
        os.killpg(frozen.process.pid, signal.SIGCONT)
        stack.stop()
    assert [o for o in outcomes if o.error] == []
    name = "replica-0"
    before = [o for o in outcomes if o.started < frozen_at]
    during = [o for o in outcomes if frozen_at + 1.0 <= o.started < thawed_at]
    assert any(o.endpoint == name for o in before), "the replica served before it froze"
    assert len(during) >= 150
    late = [round(o.started - frozen_at, 3) for o in during if o.endpoint == name]
    assert late == [], "routed to the frozen replica more than 1 s after it froze"


def test_replicas_whose_metrics_answer_late_under_load_keep_serving(tmp_path: Path) -> None:
    """Eight clients stream 40-token answers without a pause; after 1 s both replicas' /metrics
    answer 2 s late (vLLM's API server under heavy load), four times the EPP's scrape timeout.
    The replicas keep answering requests, so they stay in scheduling and no request fails. Once
    the load stops they show no life, and are out until their metrics answer in time again.
    Routed by the EPP's own request counts (``least-request``): scorers of scraped figures would
    route every request on the figures of the last good scrape, to one replica."""
    stack = start_stack(tmp_path, replicas=2, sim_profile="default", epp_config="least-request")
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60)
    stop, outcomes, health = threading.Event(), [], []
    names = ("replica-0", "replica-1")

    def healthy() -> list[float]:
        url = stack.epp_metrics_url
        return [metric_sum(url, "llm_epp_endpoint_healthy", model_server_pod=n) for n in names]

    def client_loop(worker: int) -> None:
        for i in range(10**6):
            if stop.is_set():
                return
            outcomes.append(_streamed_completion(client, 40, f"{worker}-{i} Tell me a story"))

    def delay_metrics(seconds: float) -> None:
        for replica in range(2):
            url = f"{stack.replica_url(replica)}/admin/metrics-delay"
            assert httpx.post(url, json={"seconds": seconds}).status_code == 200

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for worker in range(8):
                pool.submit(client_loop, worker)
            time.sleep(1.0)
            delay_metrics(2.0)
            delayed_at = time.monotonic()
            while time.monotonic() < delayed_at + 5.0:
                health.append(healthy())
                time.sleep(0.1)
            stop.set()
        assert wait_for(lambda: healthy() == [0, 0], timeout=5), "idle with late metrics: no sign of life"
        delay_metrics(0.0)
        assert wait_for(lambda: healthy() == [1, 1], timeout=5)
    finally:
        stop.set()
        stack.stop()
    assert [o for o in outcomes if o.error] == []
    during = [o for o in outcomes if o.started >= delayed_at + 1.0]
    assert len(during) >= 40 and {o.endpoint for o in during} == set(names)
    assert all(h == [1, 1] for h in health), health


def test_idle_gaps_longer_than_the_engines_keep_alive_fail_no_request(tmp_path: Path) -> None:
    """Bursts of short requests with idle gaps longer than the engines' keep-alive (uvicorn's
    5 s, as in vLLM): Envoy closes its idle upstream connections first, so no engine ever closes
    one under a request Envoy is sending."""
    stack = start_stack(tmp_path, replicas=2, sim_profile="instant")
    bursts, per_burst, concurrency, gap_s = 4, 500, 8, 5.5
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}

    async def burst(client: httpx.AsyncClient) -> list[int]:
        todo = iter(range(per_burst))

        async def worker() -> list[int]:
            return [(await client.post("/v1/completions", json=body)).status_code for _ in todo]

        return [
            s for statuses in await asyncio.gather(*(worker() for _ in range(concurrency))) for s in statuses
        ]

    async def replay() -> list[int]:
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
            for i in range(bursts):
                if i:
                    await asyncio.sleep(gap_s)
                statuses += await burst(client)
        return statuses

    try:
        statuses = asyncio.run(replay())
        idle_closed = stat(stack.config.ports.envoy_admin, "cluster.model_servers.upstream_cx_idle_timeout")
        remote_closed = stat(
            stack.config.ports.envoy_admin, "cluster.model_servers.upstream_cx_destroy_remote"
        )
    finally:
        stack.stop()
    assert len(statuses) == bursts * per_burst
    assert {s: statuses.count(s) for s in set(statuses)} == {200: bursts * per_burst}
    assert idle_closed >= 1, "Envoy closed idle upstream connections in the gaps"
    assert remote_closed == 0, "an engine closed a connection Envoy still held"


class _ResettingEngine(BaseHTTPRequestHandler):
    """Answers ``GET /metrics`` with a real replica's metrics, and closes the connection on
    every other request before sending a byte (an engine crashing, or closing a keep-alive
    connection, as a request arrives)."""

    protocol_version = "HTTP/1.1"
    metrics = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(self.metrics)))
        self.end_headers()
        self.wfile.write(self.metrics)

    def do_POST(self) -> None:
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("metering", "callout"), [("first-token", "ext-proc"), ("full", "ext-proc"), ("first-token", "ext-authz")]
)
def test_a_request_reset_before_any_byte_is_retried_on_the_epps_next_pick(
    tmp_path: Path, metering: str, callout: str
) -> None:
    """The EPP picks round-robin over ``engine-a`` (which resets every inference request) and
    the two replicas, listing two endpoints per request: a streamed request whose first pick is
    ``engine-a`` must be served by its second, ``replica-0``, not by any other endpoint, and the
    EPP, told by Envoy which endpoint answered, books it there and finishes it there, from the
    stream or from the access log. Over ext_proc the debug header, sent with the response,
    names where it was booked; over ext_authz it is the routing's answer, so it names the pick."""
    config = tmp_path / "round-robin-2.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "llm-d.ai/v1alpha1",
                "kind": "EndpointPickerConfig",
                "plugins": [{"type": "round-robin", "parameters": {"maxNumOfEndpoints": 2}}],
                "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "round-robin"}]}],
            }
        )
    )
    stack = start_stack(
        tmp_path,
        replicas=2,
        sim_profile="instant",
        epp_config=str(config),
        response_metering=metering,
        callout=callout,
    )
    _ResettingEngine.metrics = httpx.get(stack.replica_url(1) + "/metrics", timeout=5).content
    engine = ThreadingHTTPServer(("127.0.0.1", 0), _ResettingEngine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        endpoints = {
            "engine-a": ("127.0.0.1", engine.server_address[1]),
            **{f"replica-{i}": ("127.0.0.1", stack.replica_ports[i]) for i in (0, 1)},
        }
        write_cluster_endpoints(stack.cluster_endpoints_file, list(endpoints.values()))
        entries = [{"name": n, "address": a, "port": p} for n, (a, p) in endpoints.items()]
        tmp = tmp_path / "endpoints.tmp"
        tmp.write_text(yaml.safe_dump({"endpoints": entries}))
        tmp.replace(stack.workdir / "endpoints.yaml")
        clusters = f"http://127.0.0.1:{stack.config.ports.envoy_admin}/clusters"
        engine_host = f"model_servers::127.0.0.1:{engine.server_address[1]}::"
        assert wait_for(lambda: engine_host in httpx.get(clusters, timeout=5).text)
        healthy = "llm_epp_endpoint_healthy"
        assert wait_for(lambda: metric_sum(stack.epp_metrics_url, healthy, model_server_pod="engine-a") == 1)
        served = [metric_sum(stack.replica_url(i) + "/metrics", "vllm:request_success_total") for i in (0, 1)]
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "stream": True}
        picks = []
        for _ in range(30):
            response = httpx.post(f"{stack.gateway_url}/v1/completions", json=body, headers=DEBUG, timeout=10)
            assert response.status_code == 200, response.text
            assert "x-llm-epp-served-by" not in response.headers  # for the EPP only
            picks.append(response.headers["x-llm-epp-endpoint"])
        in_flight = "llm_epp_endpoint_in_flight_requests"
        assert wait_for(lambda: metric_sum(stack.epp_metrics_url, in_flight) == 0)
        completed = metric_sum(stack.epp_metrics_url, "inference_objective_request_duration_seconds_count")
        retried = stat(stack.config.ports.envoy_admin, "cluster.model_servers.upstream_rq_retry")
        now = [metric_sum(stack.replica_url(i) + "/metrics", "vllm:request_success_total") for i in (0, 1)]
    finally:
        engine.shutdown()
        stack.stop()
    if callout == "ext-proc":
        assert picks.count("engine-a") == 0  # every request is booked where it was served
        assert (picks.count("replica-0"), picks.count("replica-1")) == (20, 10)
    else:
        assert [picks.count(e) for e in ("engine-a", "replica-0", "replica-1")] == [10, 10, 10]
    assert completed == 30
    assert retried == 10
    assert now[0] - served[0] == picks.count("replica-0") + picks.count("engine-a")
    assert now[1] - served[1] == picks.count("replica-1")
