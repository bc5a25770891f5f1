"""Request bodies through real Envoy in each ext_proc body mode: BUFFERED (the local gateway's)
and FULL_DUPLEX_STREAMED (the anchor's gateways'), where the EPP re-emits the body it collected."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from sim.stack import LocalStack
from tests.stacks import metric_sum, requests_settled, start_stack

pytestmark = pytest.mark.integration
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module", params=["BUFFERED", "FULL_DUPLEX_STREAMED"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("stack"),
        replicas=2,
        sim_profile="instant",
        body_mode=request.param,
        epp_args=["--max-body-bytes", str(256 << 10)],
    )
    yield s
    s.stop()


def _chunked(body: bytes, size: int) -> Iterator[bytes]:
    """The body as a chunked upload, so Envoy receives (and, streamed, sends) it in pieces."""
    for i in range(0, len(body), size):
        yield body[i : i + size]


def test_a_chunked_upload_reaches_the_replica_whole(stack: LocalStack) -> None:
    prompt = "word " * 15_000  # ~75 KB: several chunks, and more than one re-emitted chunk
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        content=_chunked(body, 16 << 10),
        headers=JSON,
        timeout=30,
    )
    assert response.status_code == 200, response.text
    # The replica got the body the client sent, byte for byte: it counts the prompt as directly.
    direct = httpx.post(stack.replica_url(0) + "/v1/completions", content=body, headers=JSON, timeout=30)
    assert response.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"] > 10_000


def test_streamed_response_is_metered(stack: LocalStack) -> None:
    assert requests_settled(stack)
    before = metric_sum(stack.epp_metrics_url, "inference_objective_output_tokens_sum")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stack.gateway_url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 5
    assert requests_settled(stack)
    assert metric_sum(stack.epp_metrics_url, "inference_objective_output_tokens_sum") - before == 5


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "tiny", "prompt": ', 400),
        (json.dumps({"model": "tiny", "prompt": "x" * (300 << 10)}).encode(), 413),
    ],
)
def test_refused_bodies_get_the_epps_json_error(stack: LocalStack, body: bytes, status: int) -> None:
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        content=_chunked(body, 64 << 10),
        headers=JSON,
        timeout=10,
    )
    assert response.status_code == status
    assert response.json()["error"]["code"] == status
    ok = httpx.post(
        f"{stack.gateway_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
    )
    assert ok.status_code == 200
