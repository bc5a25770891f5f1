"""The ext_authz callout: a check's answer, the access log finishing what it routed, and the
HTTP server over a real socket."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

from epp.extauthz.check import CHECK_PATH_PREFIX, SOURCE_HEADER, Check, CheckAnswer, ExtAuthzCheck
from epp.extauthz.server import serve
from epp.extproc.access_log import log_entry
from epp.extproc.messages import DESTINATION_HEADER
from epp.requestcontrol.completion_log import LogEntry
from tests.epp.extproc_harness import Harness

LABELS = {"model_name": "tiny", "target_model_name": "tiny"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stream": True}


def check(body: object = CHAT, path: str = "/v1/chat/completions", **headers: str) -> Check:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    base = {"content-type": "application/json", SOURCE_HEADER: "127.0.0.1", "x-envoy-internal": "true"}
    return Check("POST", CHECK_PATH_PREFIX + path, {**base, **headers}, raw)


async def test_a_routed_check_names_the_pick_and_fallbacks_and_the_log_finishes_the_request() -> None:
    h = Harness(config="ray-kv-aware")
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    answer = await checker.answer(check(**{"x-request-id": "r1"}))
    assert answer.status == 200 and answer.body == b""
    picks = answer.headers[DESTINATION_HEADER].split(",")
    assert picks and set(picks) <= {"10.0.0.1:8000", "10.0.0.1:8001"}
    assert answer.headers["x-request-id"] == "r1"
    assert "x-llm-epp-endpoint" not in answer.headers  # no trace asked for
    assert h.in_flight() == 1 and h.metric("llm_epp_handed_off_requests") == 1
    h.clock.advance(2.0)
    # The gateway saw the first body byte 0.3 s in and counted 12 JSON events (role + 11 tokens).
    h.director.log_entry(LogEntry("r1", 200, 900, 1.5, "complete", sse_events=12, first_body_byte_s=0.3))
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0
    assert h.metric("inference_objective_request_ttft_seconds_sum", **LABELS) == pytest.approx(0.3)
    assert h.metric("inference_objective_output_tokens_sum", **LABELS) == 11
    assert h.metric("inference_objective_request_tpot_seconds_sum", **LABELS) == pytest.approx(1.2 / 10)


async def test_a_usage_event_is_not_a_token_and_a_periodic_entry_gives_the_first_token() -> None:
    h = Harness(config="ray-kv-aware")
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    body = {**CHAT, "stream_options": {"include_usage": True}}
    await checker.answer(check(body, **{"x-request-id": "r2"}))
    h.clock.advance(1.0)
    h.director.log_entry(LogEntry("r2", 200, 300, 0.9, "complete", intermediate=True, first_body_byte_s=0.25))
    assert h.metric("llm_epp_handed_off_requests") == 1  # still streaming
    h.director.log_entry(LogEntry("r2", 200, 900, 1.0, "complete", sse_events=12, first_body_byte_s=0.25))
    assert h.metric("inference_objective_request_ttft_seconds_sum", **LABELS) == pytest.approx(0.25)
    assert h.metric("inference_objective_output_tokens_sum", **LABELS) == 10  # role and usage


def prefill_and_decode(h: Harness) -> tuple[int, int]:
    assert h.tracker is not None
    loads = [h.tracker.load(name) for name in ("e0", "e1")]
    return sum(x.prefill_tokens for x in loads), sum(x.decode_tokens for x in loads)


async def test_an_unseen_first_token_is_estimated_then_corrected_by_the_log() -> None:
    h = Harness(healthy=1, config="ray-kv-aware")  # one endpoint: the delay learned is its own
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    await checker.answer(check(**{"x-request-id": "r1"}))
    prefill, decode = prefill_and_decode(h)
    assert prefill > 0 and decode == 0
    h.clock.advance(1.0)
    h.director.estimate_progress()  # no TTFT known for the endpoint: decoding from now on
    assert prefill_and_decode(h)[0] == 0 and prefill_and_decode(h)[1] > 0
    h.director.log_entry(LogEntry("r1", 200, 900, 1.5, "complete", sse_events=12, first_body_byte_s=0.4))
    # The outcome reports the logged first token, not the estimate.
    assert h.metric("inference_objective_request_ttft_seconds_sum", **LABELS) == pytest.approx(0.4)
    assert prefill_and_decode(h) == (0, 0)
    # The next stream there waits for the endpoint's recent time to first token (0.4 s).
    await checker.answer(check(**{"x-request-id": "r2", "x-llm-epp-debug": "true"}))
    h.clock.advance(0.3)
    h.director.estimate_progress()
    assert prefill_and_decode(h)[1] == 0
    h.clock.advance(0.2)
    h.director.estimate_progress()
    assert prefill_and_decode(h)[1] > 0


async def test_refusals_are_json_errors_and_leave_nothing_booked() -> None:
    h = Harness(config="ray-kv-aware", max_body=1000)
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    bad = await checker.answer(check(b'{"model": "tiny", "messages": '))
    assert bad.status == 400 and bad.headers["content-type"] == "application/json"
    assert json.loads(bad.body)["error"]["code"] == 400
    big = await checker.answer(check({**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}))
    assert big.status == 413
    crowded = await checker.answer(check(**{f"x-h{i}": "v" for i in range(120)}))
    assert crowded.status == 431
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0


async def test_traces_go_to_admitted_sources_only_and_the_gateways_headers_are_not_the_clients() -> None:
    h = Harness(config="ray-kv-aware")
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    traced = await checker.answer(check(**{"x-llm-epp-debug": "true"}))
    assert traced.headers["x-llm-epp-endpoint"] in {"e0", "e1"}
    stranger = await checker.answer(check(**{"x-llm-epp-debug": "true", SOURCE_HEADER: "10.9.9.9"}))
    assert "x-llm-epp-endpoint" not in stranger.headers
    routed = list(h.director.handoffs.waiting())
    assert len(routed) == 2
    assert all(SOURCE_HEADER not in r.routed.request.headers for r in routed if r.routed)
    assert all("x-envoy-internal" not in r.routed.request.headers for r in routed if r.routed)


async def test_a_bodyless_check_is_routed_and_not_booked() -> None:
    h = Harness()
    checker = ExtAuthzCheck(h.director, h.max_body, h.gate)
    answer = await checker.answer(Check("GET", f"{CHECK_PATH_PREFIX}/v1/models", {}, b""))
    assert answer.status == 200 and answer.headers[DESTINATION_HEADER]
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0


async def test_a_cancelled_check_releases_its_request() -> None:
    h = Harness(config="ray-kv-aware")
    started = asyncio.Event()

    class Slow(ExtAuthzCheck):
        async def _route(self, record, headers, body):  # type: ignore[no-untyped-def]
            started.set()
            await asyncio.sleep(60)
            raise AssertionError("not reached")

    task = asyncio.create_task(Slow(h.director, h.max_body, h.gate).answer(check(**{"x-request-id": "gone"})))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "gone" not in h.director.live_ids


def test_the_gateways_marks_are_read_from_the_entry() -> None:
    raw = HTTPAccessLogEntry()
    raw.request.request_id = "r"
    raw.common_properties.start_time.FromMicroseconds(1_000_000_000)
    marks = {"first_body_byte_us": str(1_000_000_000 + 250_000), "sse_events": 42}
    raw.common_properties.metadata.filter_metadata["llm_epp"].update(marks)
    entry = log_entry(raw)
    assert entry.first_body_byte_s == pytest.approx(0.25) and entry.sse_events == 42
    assert log_entry(HTTPAccessLogEntry()).first_body_byte_s is None


async def test_the_server_answers_checks_in_order_on_a_kept_alive_connection() -> None:
    seen: list[Check] = []

    async def answer(c: Check) -> CheckAnswer:
        seen.append(c)
        return CheckAnswer(200 if c.body else 429, {"x-picked": c.path}, b"" if c.body else b'{"e":1}')

    ready = [True]
    server = await serve(answer, lambda: ready[0], "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for body in (b"abc", b""):
            writer.write(
                b"POST /ext-authz/v1/completions?x=1 HTTP/1.1\r\nHost: epp\r\nX-Two: a\r\nx-two: b\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        first = await reader.readuntil(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-picked: /ext-authz/v1/completions" in first
        second = await reader.readuntil(b"\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
        assert await reader.readexactly(7) == b'{"e":1}'
        assert seen[0].headers["x-two"] == "a,b" and seen[0].body == b"abc" and seen[0].method == "POST"
        for expected in (b"200", b"503"):
            writer.write(b"GET /ready HTTP/1.1\r\nHost: epp\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 " + expected)
            ready[0] = False
        writer.write(b"NOT HTTP\r\n\r\n")
        bad = await reader.read()
        assert bad.startswith(b"HTTP/1.1 400 Bad Request") and b"BadRequestError" in bad
        writer.close()
    finally:
        server.close()
