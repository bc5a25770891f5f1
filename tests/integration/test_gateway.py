"""End to end through real Envoy → EPP → simulated vLLM replicas, with the official openai client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sim.processes import EPP_ALLOCATOR
from sim.stack import LocalStack
from tests.stacks import requests_settled
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration
LONG_PROMPT = "You are a helpful assistant for a shipping company. " * 40


def test_completion_non_streamed(client: openai.OpenAI) -> None:
    response = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5)
    assert response.choices[0].text
    assert response.usage.completion_tokens == 5 and response.usage.prompt_tokens == 5


def test_completion_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=6, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 6


def test_chat_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_non_streamed(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert response.choices[0].message.role == "assistant" and response.usage.completion_tokens == 3


def test_models_list_goes_to_any_ready_endpoint(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_shared_long_prefix_lands_where_it_is_cached(client: openai.OpenAI) -> None:
    first = client.completions.create(model="tiny", prompt=LONG_PROMPT + "Question one?", max_tokens=2)
    assert first.usage.prompt_tokens > 512
    cached = []
    for i in range(4):
        r = client.completions.create(model="tiny", prompt=LONG_PROMPT + f"Question {i + 2}?", max_tokens=2)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    # Every follow-up found the shared prefix in its replica's cache: the EPP kept them together.
    assert min(cached) >= 512, cached


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "tiny", "prompt": ', 400, "body.28"),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "five"}).encode(), 400, "body.max_tokens"),
        (json.dumps({"model": "tiny", "prompt": 42}).encode(), 400, "body.prompt"),
        (json.dumps({"model": "tiny", "prompt": "x", "cache_salt": ""}).encode(), 400, "cache_salt"),
        (json.dumps({"model": "tiny", "prompt": "x" * (300 << 10)}).encode(), 413, None),
    ],
)
def test_bad_requests_get_json_errors(stack: LocalStack, body: bytes, status: int, param: str | None) -> None:
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param
    # The EPP is still up and routing.
    ok = httpx.post(
        f"{stack.gateway_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
    )
    assert ok.status_code == 200


def test_the_expected_output_hint_is_read_at_the_gateway(stack: LocalStack) -> None:
    url = f"{stack.gateway_url}/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    bad = httpx.post(url, json=body, headers={"x-expected-output-tokens": "about 100"}, timeout=10)
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/json"
    error = bad.json()["error"]
    assert error["param"] == "x-expected-output-tokens" and "x-expected-output-tokens" in error["message"]
    good = httpx.post(url, json=body, headers={"x-expected-output-tokens": "100"}, timeout=10)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("POST", "/tokenize"),
        ("POST", "/v1/embeddings"),
        ("GET", "/"),
    ],
)
def test_only_inference_api_paths_reach_a_replica(stack: LocalStack, method: str, path: str) -> None:
    response = httpx.request(
        method, stack.gateway_url + path, json={"model": "tiny", "prompt": "x"}, timeout=10
    )
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", None, 404)
    assert error["message"].startswith("not an inference API path")


def test_headers_over_the_limit_get_a_json_431(stack: LocalStack) -> None:
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        headers={"x-padding": "a" * (61 << 10)},
        timeout=10,
    )
    # The EPP's answer: Envoy's own limits sit above the ones it enforces (epp.extproc.gate).
    assert response.status_code == 431
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("RequestHeaderFieldsTooLargeError", None, 431)
    assert error["message"].startswith("request headers too large: ")


def test_hostile_headers_cannot_pick_the_upstream(stack: LocalStack) -> None:
    hostile_id = "$(rm -rf /) " + "A" * 4000
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        headers={"x-gateway-destination-endpoint": "127.0.0.1:1", "x-request-id": hostile_id},
        timeout=10,
    )
    assert response.status_code == 200
    # The EPP replaced the hostile id with one of its own (a fresh UUID); a plain id is kept.
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers["x-request-id"]
    plain = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        headers={"x-request-id": "client-id-1"},
        timeout=10,
    )
    assert plain.headers["x-request-id"] == "client-id-1"


def test_client_disconnect_mid_stream_is_cleaned_up(stack: LocalStack) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    # The EPP notices the reset and releases the endpoint.
    assert requests_settled(stack)
    aborted = metric_sum(
        stack.epp_metrics_url, "inference_objective_request_error_total", error_code="aborted"
    )
    assert aborted >= 1
    ok = httpx.post(
        f"{stack.gateway_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("service", ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"])
def test_grpc_health_reports_serving(stack: LocalStack, service: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.config.ports.epp_health}") as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def _ext_proc_counts(stack: LocalStack) -> dict[str, float]:
    """Envoy's ext_proc counters (streams started, messages sent to and received from the EPP)."""
    admin = f"http://127.0.0.1:{stack.config.ports.envoy_admin}/stats"
    text = httpx.get(admin, params={"filter": r"ext_proc\.(streams_started|stream_msgs_)"}, timeout=5).text
    return {line.split(": ")[0].rsplit(".", 1)[1]: float(line.split(": ")[1]) for line in text.splitlines()}


def test_a_non_streamed_request_costs_two_ext_proc_messages_each_way_and_the_log_finishes_it(
    stack: LocalStack, client: openai.OpenAI
) -> None:
    """Request headers and body: with first-token metering the EPP ends the stream at the
    routing, and the request is finished (and its E2E measured) from its access-log entry."""
    finished = "inference_objective_request_duration_seconds_count"
    assert requests_settled(stack)
    done_before = metric_sum(stack.epp_metrics_url, finished)
    before = _ext_proc_counts(stack)
    assert client.completions.create(model="tiny", prompt="Hello world", max_tokens=3).choices[0].text
    after = _ext_proc_counts(stack)
    delta = {name: after[name] - before[name] for name in after}
    assert delta == {"streams_started": 1, "stream_msgs_sent": 2, "stream_msgs_received": 2}
    assert wait_for(lambda: metric_sum(stack.epp_metrics_url, finished) == done_before + 1)
    assert metric_sum(stack.epp_metrics_url, "llm_epp_endpoint_in_flight_requests") == 0


def test_a_streamed_answer_crosses_ext_proc_to_its_first_token_and_is_counted_from_the_log(
    stack: LocalStack, client: openai.OpenAI
) -> None:
    tokens = "inference_objective_output_tokens_sum"
    for _ in range(4):  # the kind's calibration streams, read to their end
        list(client.completions.create(model="tiny", prompt="Hello", max_tokens=5, stream=True))
    # Every earlier answer counted, handed-off ones included (their access-log entries are in).
    assert wait_for(lambda: metric_sum(stack.epp_metrics_url, "llm_epp_handed_off_requests") == 0)
    counted = metric_sum(stack.epp_metrics_url, tokens)
    before = _ext_proc_counts(stack)
    with client.completions.with_streaming_response.create(
        model="tiny", prompt="Hello", max_tokens=40, stream=True
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["text"]) == 40
    # Estimated from the answer's bytes, by a line fitted on the streams read whole (here the
    # module's earlier short answers, so the line is extrapolated: within a quarter).
    assert wait_for(lambda: metric_sum(stack.epp_metrics_url, tokens) > counted)
    assert metric_sum(stack.epp_metrics_url, tokens) - counted == pytest.approx(40, rel=0.25)
    after = _ext_proc_counts(stack)
    delta = {name: after[name] - before[name] for name in after}
    # The EPP answers the request's headers and body and the first token's chunk (it asked for
    # no response headers: the status and the server come with that chunk); Envoy may have sent
    # on a few more chunks before it read the EPP's close (how many depends on timing: up to 10
    # seen), but not the whole answer's 42: the rest go by without the EPP.
    whole = 2 + len(events) + 2  # request, every chunk, the role chunk and [DONE]
    assert 3 <= delta["stream_msgs_sent"] < whole / 2 and delta["stream_msgs_received"] == 3, delta


def test_streamed_answers_the_sdk_hangs_up_on_at_done_are_metered_in_full(
    stack: LocalStack, client: openai.OpenAI
) -> None:
    """The SDK closes its connection on reading `data: [DONE]`; now and then that beats the
    engine's end of body to Envoy, which then closes the ext_proc stream without it."""
    tokens = "inference_objective_output_tokens_sum"
    aborted = "inference_objective_request_error_total"
    assert requests_settled(stack)
    counted = metric_sum(stack.epp_metrics_url, tokens)
    aborts = metric_sum(stack.epp_metrics_url, aborted, error_code="aborted")
    for _ in range(30):
        chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=7, stream=True))
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 7
    assert requests_settled(stack)
    assert metric_sum(stack.epp_metrics_url, tokens) == counted + 30 * 7
    assert metric_sum(stack.epp_metrics_url, aborted, error_code="aborted") == aborts


def test_the_epp_runs_on_the_preloaded_allocator(stack: LocalStack) -> None:
    mapped = Path(f"/proc/{stack.epp.process.pid}/maps").read_text()
    assert EPP_ALLOCATOR in mapped
    assert stack.epp.alive()
