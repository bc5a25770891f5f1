"""The hostile corpus (``tests.gateway_corpus``) through real Envoy → EPP → simulated replica,
over HTTP/1.1, HTTP/2 and HTTP/1.0: no 5xx, and every 4xx an OpenAI-shaped JSON error with a
message, whoever answered it (Envoy, the EPP or the replica)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.envoy_config import CODEC_MAX_HEADERS
from sim.stack import LocalStack
from tests import raw_h2
from tests.gateway_corpus import COMPLETION, Answer, corpus, run_with_curl
from tests.stacks import start_stack

pytestmark = pytest.mark.integration
CASES = corpus()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # A replica is out of scheduling after --scrape-timeout-s without a scrape: on a loaded test
    # machine that would answer some requests 503, which is not what this corpus tests.
    s = start_stack(
        tmp_path_factory.mktemp("corpus"),
        replicas=1,
        sim_profile="instant",
        epp_args=["--scrape-timeout-s", "10"],
    )
    yield s
    s.stop()


def _problem(answer: Answer) -> str | None:
    """What is wrong with ``answer``, or None."""
    if answer.status == 0:
        return "no response"
    if answer.status >= 500:
        return f"{answer.status}: {answer.body[:200]!r}"
    if answer.status < 400 or answer.case.method == "HEAD":
        return None
    if answer.content_type not in ("application/json", None):
        return f"{answer.status} as {answer.content_type!r}: {answer.body[:200]!r}"
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{answer.status} not an OpenAI error: {answer.body[:200]!r}"
    if not (isinstance(error.get("message"), str) and error["message"] and error.get("type")):
        return f"{answer.status} without a message or type: {error}"
    if error.get("code") != answer.status:
        return f"{answer.status} with code {error.get('code')}"
    return None


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 500
    assert sum(len(c.protocols) for c in CASES) >= 1000


@pytest.mark.parametrize("protocol", ["1.1", "2", "1.0"])
def test_no_5xx_and_json_errors(stack: LocalStack, tmp_path: Path, protocol: str) -> None:
    cases = [c for c in CASES if protocol in c.protocols]
    answers = run_with_curl(stack.gateway_url, cases, protocol, tmp_path)
    problems = {a.case.name: p for a in answers if (p := _problem(a)) is not None}
    assert problems == {}
    statuses = {a.case.name: a.status for a in answers}
    if protocol == "1.0":
        assert statuses["HTTP/1.0 completion"] == 200 and statuses["HTTP/1.0 101 extra headers"] == 431
        return
    # Around the limits: served while the EPP's headers fit, then a 431; never a 500.
    served = [n for n in range(111) if statuses[f"{n} extra headers, POST"] == 200]
    assert served == list(range(len(served))) and 80 <= len(served) < 100
    assert {statuses[f"{n} extra headers, POST"] for n in range(len(served), 111)} == {431}
    assert statuses["a 58 KiB header"] == 200 and statuses["a 70 KiB header"] == 431
    assert statuses["PUT /v1/completions"] == 405 and statuses["GET /v1/completions"] == 405
    assert statuses["path /metrics"] == 404 and statuses["path /dashboard"] == 404
    if protocol == "1.1":
        assert statuses["/v1/completions: over 16 MiB"] == 413
    # A client cannot choose its replica's address: the request is routed as any other.
    assert statuses["own destination evil.example:80"] == 200


@pytest.mark.parametrize("kib", [62, 66, 80, 95])
def test_http2_headers_between_the_epps_limit_and_envoys_get_the_json_431(
    stack: LocalStack, kib: int
) -> None:
    # Past 64 KiB curl will not send them, and Envoy's HTTP/2 codec refuses one field over
    # 64 KiB unless max_header_field_size_kb says otherwise (the gateway sets it to 96).
    port = int(stack.gateway_url.rsplit(":", 1)[1])
    headers = [("content-type", "application/json"), ("x-big", "a" * (kib << 10))]
    reply = raw_h2.request("127.0.0.1", port, "/v1/completions", headers, COMPLETION)
    assert (reply.status, reply.reset) == (431, None)
    assert json.loads(reply.body)["error"]["type"] == "RequestHeaderFieldsTooLargeError"


def test_http2_headers_past_envoys_limits_end_the_stream_or_connection(stack: LocalStack) -> None:
    """The closest Envoy comes to a 431 over HTTP/2: no response, never a 5xx."""
    port = int(stack.gateway_url.rsplit(":", 1)[1])
    big = raw_h2.request("127.0.0.1", port, "/v1/completions", [("x-big", "a" * (97 << 10))], COMPLETION)
    assert (big.status, big.reset) == (None, raw_h2.COMPRESSION_ERROR)  # GOAWAY: the connection
    many = [(f"x-h{i}", "v") for i in range(CODEC_MAX_HEADERS)]
    counted = raw_h2.request("127.0.0.1", port, "/v1/completions", many, COMPLETION)
    assert (counted.status, counted.reset) == (None, raw_h2.INTERNAL_ERROR)  # RST_STREAM: the stream
