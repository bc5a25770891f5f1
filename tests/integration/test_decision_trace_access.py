"""Decision traces through real Envoy for the callers the operator allowed only: here, by token
(``--decision-trace-token-file``), with no network allowed, so a loopback ``true`` gets nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack

pytestmark = pytest.mark.integration
TOKEN = "operator-only-7f3a"
TRACE_HEADERS = ("x-llm-epp-endpoint", "x-llm-epp-decision")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("traces")
    (workdir / "trace-token").write_text(TOKEN + "\n")
    s = start_stack(
        workdir,
        replicas=2,
        sim_profile="instant",
        decision_trace_from=(),
        epp_args=["--decision-trace-token-file", str(workdir / "trace-token")],
    )
    yield s
    s.stop()


def _traced(stack: LocalStack, value: str) -> list[str]:
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 2}
    response = httpx.post(
        f"{stack.gateway_url}/v1/completions", json=body, headers={"x-llm-epp-debug": value}, timeout=30
    )
    assert response.status_code == 200, response.text
    return [h for h in response.headers if h.startswith("x-llm-epp-")]


@pytest.mark.parametrize("value", ["true", "TRUE", "1", TOKEN[:-1], TOKEN + "x", "", "garbage"])
def test_callers_without_the_token_get_no_trace_and_no_error(stack: LocalStack, value: str) -> None:
    assert _traced(stack, value) == []


def test_the_token_gets_the_trace(stack: LocalStack) -> None:
    assert set(TRACE_HEADERS) <= set(_traced(stack, TOKEN))


@pytest.mark.parametrize("path", ["/metrics", "/dashboard", "/dashboard/data", "/healthz"])
def test_the_epps_live_page_and_metrics_are_not_behind_the_gateway(stack: LocalStack, path: str) -> None:
    direct = httpx.get(stack.epp_metrics_url.removesuffix("/metrics") + path, timeout=10)
    assert direct.status_code == 200  # served on the EPP's own port...
    response = httpx.get(stack.gateway_url + path, timeout=10)
    # ...and not through the gateway.
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"
