"""Hostile bodies and oversized prompts through real Envoy: JSON 400s from the EPP, no traceback.

The replica serves a 2,048-token context; the EPP has no ``--max-model-len`` and learns the
context from the replica's ``/v1/models``. Requests carry ``x-llm-epp-debug``, so a response
that went through a replica names it in ``x-llm-epp-endpoint``; the EPP's own answers do not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from sim.stack import LocalStack
from tests.hostile_bodies import HOSTILE
from tests.stacks import start_stack
from tests.support import wait_for

pytestmark = pytest.mark.integration
MAX_MODEL_LEN = 2048
LONG_TEXT = "hello world " * 1200  # ~2,400 tokens: under the character bound, over the context
TEN_MIB_PROMPT = {"model": "tiny", "prompt": "hello world " * ((10 << 20) // 12), "max_tokens": 1}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("hostile"),
        replicas=1,
        sim_profile="instant",
        sim_args=["--max-model-len", str(MAX_MODEL_LEN)],
    )
    yield s
    s.stop()


def post(url: str, path: str, body: bytes, request_id: str = "") -> httpx.Response:
    headers = {"content-type": "application/json", "x-llm-epp-debug": "true"}
    if request_id:
        headers["x-request-id"] = request_id
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=30)


def answered_by_the_epp(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert "x-llm-epp-endpoint" not in response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.fixture(scope="module")
def context_learned(stack: LocalStack) -> None:
    """Wait until the EPP refuses a prompt over the context itself: it has read /v1/models."""
    body = json.dumps({"model": "tiny", "prompt": LONG_TEXT}).encode()
    assert wait_for(
        lambda: "x-llm-epp-endpoint" not in post(stack.gateway_url, "/v1/completions", body).headers
    )


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_get_a_json_400_and_one_log_line(stack: LocalStack, case: str) -> None:
    path, body = HOSTILE[case]
    request_id = f"hostile-{list(HOSTILE).index(case)}"
    answered_by_the_epp(post(stack.gateway_url, path, body, request_id), 400)
    assert wait_for(lambda: f"request {request_id} answered 400" in stack.epp.log_path.read_text())
    log = stack.epp.log_path.read_text()
    assert log.count(f"request {request_id} ") == 1 and "Traceback" not in log


@pytest.mark.usefixtures("context_learned")
@pytest.mark.parametrize(
    ("prompt", "param"), [(LONG_TEXT, "input_tokens"), (TEN_MIB_PROMPT["prompt"], "input_text")]
)
def test_prompts_over_the_context_get_the_engines_answer_from_the_epp(
    stack: LocalStack, prompt: str, param: str
) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
    error = answered_by_the_epp(post(stack.gateway_url, "/v1/completions", body), 400)
    direct = httpx.post(
        f"{stack.replica_url(0)}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert direct.status_code == 400 and error == direct.json()["error"]
    assert error["param"] == param and f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_the_gateway_still_serves_after_the_hostile_requests(stack: LocalStack) -> None:
    for path, body in HOSTILE.values():
        post(stack.gateway_url, path, body)
    ok = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        timeout=10,
    )
    assert ok.status_code == 200 and stack.epp.alive()
    assert "Traceback" not in stack.epp.log_path.read_text()
