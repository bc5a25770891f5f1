"""The request gate: headers that leave no room for the EPP's own get a JSON 431, and only the
callers the operator allowed get decision traces (by token or by source network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from pydantic import ValidationError

from epp.extproc.gate import ADDED_BYTES, ADDED_HEADERS, DebugAccess, HeaderLimits, RequestGate
from epp.settings import EppSettings
from tests.epp.extproc_harness import Harness, body_msg, headers_msg, response_headers_msg
from wire.auth import TokenFileError

BODY = json.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 4}).encode()


def header_map(count: int, value_bytes: int = 1) -> HeaderMap:
    return HeaderMap(
        headers=[HeaderValue(key=f"x-{i:03}", raw_value=b"v" * value_bytes) for i in range(count)]
    )


def test_headers_pass_while_the_epps_own_still_fit() -> None:
    limits = HeaderLimits(max_count=100, max_kb=60)
    limits.check(header_map(100 - ADDED_HEADERS))
    with pytest.raises(Exception, match=f"{101 - ADDED_HEADERS} headers") as refused:
        limits.check(header_map(101 - ADDED_HEADERS))
    assert refused.value.status == 431


def test_header_bytes_count_names_and_values() -> None:
    limits = HeaderLimits(max_count=100, max_kb=1)
    room = 1024 - ADDED_BYTES
    limits.check(HeaderMap(headers=[HeaderValue(key="x-big", raw_value=b"v" * (room - 5))]))
    with pytest.raises(Exception, match="bytes") as refused:
        limits.check(HeaderMap(headers=[HeaderValue(key="x-big", raw_value=b"v" * (room - 4))]))
    assert refused.value.status == 431


def test_decision_traces_are_off_by_default() -> None:
    assert not DebugAccess().admits("true", "127.0.0.1")


def test_a_token_admits_from_anywhere_and_only_itself(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token\n")
    access = DebugAccess.from_settings(tmp_path / "token", [])
    assert access.admits("s3cret-token", None) and access.admits(" s3cret-token ", "203.0.113.9")
    assert not access.admits("s3cret-toke", "127.0.0.1") and not access.admits("true", "127.0.0.1")


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(TokenFileError):
        DebugAccess.from_settings(tmp_path / "token", [])


@pytest.mark.parametrize(
    ("source", "admitted"),
    [("10.1.2.3", True), ("10.2.0.1", False), ("::1", True), ("fe80::1", False), (None, False), ("x", False)],
)
def test_true_admits_callers_from_the_allowed_networks(source: str | None, admitted: bool) -> None:
    access = DebugAccess.from_settings(None, ["10.1.0.0/16", "::1/128"])
    assert access.admits("true", source) is admitted
    assert not access.admits("false", source)


def test_a_bad_network_is_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not a CIDR"):
        EppSettings(
            endpoints_file=tmp_path / "e.yaml", tokenizer_dir=tmp_path, decision_trace_from=["10.0.0/x"]
        )


async def _debug_headers(h: Harness, **request_headers: str) -> dict[str, str]:
    s = h.stream()
    await s.on_message(headers_msg(buffered=True, **request_headers))
    await s.on_message(body_msg(BODY, eos=True))
    (reply,) = await s.on_message(response_headers_msg(content_type="application/json", eos=True))
    mutation = reply.response_headers.response.header_mutation
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


async def test_a_caller_not_allowed_is_served_without_a_trace(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t0ken")
    h = Harness(gate=RequestGate(debug=DebugAccess.from_settings(tmp_path / "token", ["127.0.0.1/32"])))
    assert "x-llm-epp-endpoint" in await _debug_headers(h, **{"x-llm-epp-debug": "true"})
    assert "x-llm-epp-endpoint" in await _debug_headers(
        h, source="198.51.100.7:1", **{"x-llm-epp-debug": "t0ken"}
    )
    for source, value in [("198.51.100.7:1", "true"), ("198.51.100.7:1", "guess"), ("127.0.0.1:2", "maybe")]:
        assert await _debug_headers(h, source=source, **{"x-llm-epp-debug": value}) == {}


async def test_headers_with_no_room_get_a_json_431_once_the_body_is_in() -> None:
    h = Harness()
    extra = {f"x-h{i:03}": "v" for i in range(100)}
    s = h.stream()
    assert not any(
        r.HasField("immediate_response") for r in await s.on_message(headers_msg(buffered=True, **extra))
    )
    (reply,) = await s.on_message(body_msg(BODY, eos=True))
    immediate = reply.immediate_response
    assert immediate.status.code == 431
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "RequestHeaderFieldsTooLargeError" and error["code"] == 431
    assert "at most" in error["message"]
    # A request without a body is answered at once.
    (reply,) = await h.stream().on_message(headers_msg(method="GET", path="/v1/models", eos=True, **extra))
    assert reply.immediate_response.status.code == 431
