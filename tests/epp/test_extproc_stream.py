"""The ext_proc state machine, fed Envoy's messages directly (no gRPC, no Envoy)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Mapping

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpTrailers,
    ProcessingRequest,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.extproc.envoy_contract import MAX_MESSAGE_TIMEOUT_S, MESSAGE_TIMEOUT_S
from epp.extproc.messages import (
    BODY_CHUNK_BYTES,
    CONTINUE_RESPONSE_BODY,
    CONTINUE_RESPONSE_HEADERS,
    LB_METADATA_NAMESPACE,
    SERVED_BY_ATTRIBUTE,
    SERVED_METADATA_KEY,
    extend_timeout,
    header_dict,
)
from epp.extproc.stream import Phase
from epp.observability.decision import DecisionLog
from epp.requestcontrol import handle as handle_module
from epp.requestcontrol.events import RequestEvent
from epp.requestcontrol.handle import OFFLOAD_BODY_BYTES, RequestHandle
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.tokenizer.model import GIL_FREE_CHARS, ModelTokenizer
from sim.models import TINY_MODEL_DIR
from tests.epp.extproc_harness import (
    Harness,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    routed_destination,
)
from tests.epp.factories import TEN_MIB, CountingTokenizer
from tests.hostile_bodies import HOSTILE, PATHS, request_bodies

COMPLETION = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "stream": True}


async def test_full_request_lifecycle() -> None:
    h = Harness()
    s = h.stream()
    body = json.dumps(COMPLETION).encode()
    assert await s.on_message(headers_msg(**{"x-request-id": "abc"})) == []
    assert await s.on_message(body_msg(body[:10], eos=False)) == []
    replies = await s.on_message(body_msg(body[10:], eos=True))
    assert routed_destination(replies[0]) in {"10.0.0.1:8000", "10.0.0.1:8001"}
    set_headers = {
        h.header.key: h.header.raw_value
        for h in replies[0].request_headers.response.header_mutation.set_headers
    }
    assert set_headers["content-length"] == str(len(body)).encode() and set_headers["x-request-id"] == b"abc"
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    assert h.in_flight() == 1

    h.clock.advance(0.1)
    assert (await s.on_message(response_headers_msg()))[0].HasField("response_headers")
    await s.on_message(response_body_msg(b'data: {"choices":[{"text":"a"}]}\n\n', eos=False))
    h.clock.advance(0.3)
    events = b"".join(b'data: {"choices":[{"text":"x"}]}\n\n' for _ in range(3)) + b"data: [DONE]\n\n"
    await s.on_message(response_body_msg(events, eos=True))
    s.close()
    assert s.phase is Phase.DONE and h.in_flight() == 0
    labels = {"model_name": "tiny", "target_model_name": "tiny"}
    assert h.metric("inference_objective_request_ttft_seconds_sum", **labels) == pytest.approx(0.1)
    assert h.metric("inference_objective_request_tpot_seconds_sum", **labels) == pytest.approx(0.1)


@pytest.mark.parametrize("reported", ["attribute", "metadata"])
async def test_a_request_the_gateway_served_elsewhere_is_rebooked_there(reported: str) -> None:
    h = Harness(config="ray-kv-aware")
    s = h.stream()
    await s.on_message(headers_msg(**{"x-llm-epp-debug": "true"}))
    replies = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    picked = routed_destination(replies[0])
    other = next(e for e in h.store.all() if e.endpoint.hostport != picked)
    assert other.in_flight == 0 and h.tracker is not None and h.tracker.load(other.name).requests == 0
    message = (
        response_headers_msg(attributes={SERVED_BY_ATTRIBUTE: other.endpoint.hostport})
        if reported == "attribute"
        else response_headers_msg(metadata={SERVED_METADATA_KEY: other.endpoint.hostport})
    )
    (reply,) = await s.on_message(message)
    mutation = reply.response_headers.response.header_mutation
    added = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
    assert added["x-llm-epp-endpoint"] == other.name
    assert other.in_flight == 1 and h.in_flight() == 1
    assert h.tracker.load(other.name).requests == 1 and h.tracker.in_flight() == 1
    await s.on_message(response_body_msg(b"data: [DONE]\n\n", eos=True))
    s.close()
    assert h.in_flight() == 0 and h.tracker.in_flight() == 0


async def test_large_body_is_re_emitted_in_chunks_and_oversized_body_is_413() -> None:
    h = Harness(max_body=300_000)
    s = h.stream()
    body = json.dumps({**COMPLETION, "prompt": "x " * 100_000}).encode()
    await s.on_message(headers_msg())
    replies = await s.on_message(body_msg(body, eos=True))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= BODY_CHUNK_BYTES for c in chunks) and [c.end_of_stream for c in chunks][-1]

    s2 = h.stream()
    await s2.on_message(headers_msg())
    await s2.on_message(body_msg(b"x" * 200_000, eos=False))
    (reply,) = await s2.on_message(body_msg(b"x" * 200_000, eos=False))
    assert reply.immediate_response.status.code == 413
    assert await s2.on_message(body_msg(b"x", eos=True)) == []  # the rest of the body is ignored
    s2.close()
    assert h.in_flight() == 1  # only the first request is still in flight


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (json.dumps({"model": "tiny"}).encode(), 400),  # no prompt
        (json.dumps({**COMPLETION, "max_tokens": "lots"}).encode(), 400),
    ],
)
async def test_bad_bodies_get_an_immediate_json_error(body: bytes, status: int) -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    (reply,) = await s.on_message(body_msg(body, eos=True))
    immediate = reply.immediate_response
    assert immediate.status.code == status
    assert json.loads(immediate.body)["error"]["code"] == status
    assert header_dict_of(immediate) == {"content-type": "application/json"}
    s.close()
    assert h.in_flight() == 0


def header_dict_of(immediate) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in immediate.headers.set_headers}


async def test_no_ready_endpoint_is_503_with_reason() -> None:
    h = Harness(healthy=0)
    s = h.stream()
    await s.on_message(headers_msg())
    (reply,) = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    assert reply.immediate_response.status.code == 503
    assert (
        header_dict_of(reply.immediate_response)["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    )


async def test_bodyless_get_is_routed_on_headers() -> None:
    h = Harness()
    s = h.stream()
    (reply,) = await s.on_message(headers_msg("/v1/models", "GET", eos=True))
    assert routed_destination(reply).startswith("10.0.0.1:")
    await s.on_message(response_headers_msg(200, "application/json"))
    await s.on_message(response_body_msg(b'{"data": []}', eos=True))
    s.close()
    assert h.in_flight() == 0


async def test_trailers_can_end_the_body() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    assert await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=False)) == []
    replies = await s.on_message(ProcessingRequest(request_trailers=HttpTrailers()))
    assert routed_destination(replies[0])
    assert replies[-1].HasField("request_trailers")


async def test_client_gone_mid_stream_releases_the_endpoint() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    await s.on_message(response_headers_msg())
    await s.on_message(response_body_msg(b'data: {"choices":[{"text":"a"}]}\n\n', eos=False))
    assert h.in_flight() == 1
    s.close()
    assert h.in_flight() == 0
    labels = {"model_name": "tiny", "target_model_name": "tiny", "error_code": "aborted"}
    assert h.metric("inference_objective_request_error_total", **labels) == 1


def _sse(event: Mapping[str, object]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.mark.parametrize("chat", [False, True])
async def test_a_client_that_hangs_up_on_done_before_the_body_ends_is_metered_in_full(chat: bool) -> None:
    """The sequence Envoy sends when the client (the openai SDK) closes its connection as soon as
    it reads ``data: [DONE]``, before the engine's end of body reaches Envoy: a chunk per event,
    ``[DONE]`` alone in the last one, then the stream closes with no ``end_of_stream``."""
    h = Harness()
    s = h.stream()
    request = {"model": "tiny", "max_tokens": 7, "stream": True}
    if chat:
        request["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        request["prompt"] = "Hello"
    await s.on_message(headers_msg("/v1/chat/completions" if chat else "/v1/completions", buffered=True))
    await s.on_message(body_msg(json.dumps(request).encode(), eos=True))
    await s.on_message(response_headers_msg())
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}] if chat else []
    token = {"delta": {"content": "x"}} if chat else {"text": "x"}
    events += [{"choices": [{"index": 0, **token}]} for _ in range(7)]
    for event in events:
        h.clock.advance(0.01)
        assert await s.on_message(response_body_msg(_sse(event), eos=False)) == [CONTINUE_RESPONSE_BODY]
    await s.on_message(response_body_msg(b"data: [DONE]\n\n", eos=False))
    s.close()
    labels = {"model_name": "tiny", "target_model_name": "tiny"}
    assert h.metric("inference_objective_output_tokens_sum", **labels) == 7
    assert h.metric("inference_objective_request_duration_seconds_count", **labels) == 1
    assert h.metric("inference_objective_request_error_total", **labels, error_code="aborted") == 0
    assert h.in_flight() == 0


async def test_upstream_5xx_takes_the_endpoint_out_until_next_scrape() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    replies = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    target = routed_destination(replies[0])
    await s.on_message(response_headers_msg(503, "text/plain"))
    await s.on_message(response_body_msg(b"upstream connect error", eos=True))
    s.close()
    name = "e0" if target.endswith("8000") else "e1"
    assert not h.store.is_healthy(name)
    assert [c.name for c in h.store.candidates()] == ["e1" if name == "e0" else "e0"]


def test_headers_are_lowercased_and_repeated_ones_joined() -> None:
    hm = HeaderMap(headers=[HeaderValue(key="X-A", raw_value=b"1"), HeaderValue(key="x-a", value="2")])
    assert header_dict(hm) == {"x-a": "1,2"}


async def test_buffered_body_mode_routes_in_the_body_reply() -> None:
    h = Harness()
    s = h.stream()
    (headers_reply,) = await s.on_message(headers_msg(buffered=True))
    assert headers_reply.HasField("request_headers") and not headers_reply.request_headers.HasField(
        "response"
    )
    (reply,) = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    assert reply.HasField("request_body") and routed_destination(reply).startswith("10.0.0.1:")
    # The body is left as Envoy buffered it: no body mutation, no content-length rewrite.
    assert not reply.request_body.response.HasField("body_mutation")
    assert h.in_flight() == 1


class HoldingGate:
    """A flow gate that holds every request until :attr:`release` is set, then lets it go on
    to any endpoint (its admission and its ticket, in one)."""

    held_s = 30.0

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.withdrawn = False

    def admit(self, request: object, received_at: float) -> HoldingGate:
        return self

    async def ticket(self) -> HoldingGate:
        await self.release.wait()
        return self

    def withdraw(self) -> None:
        self.withdrawn = True

    def restrict(self, candidates: object) -> object:
        return candidates

    def routed(self, *args: object) -> None:
        pass

    def finished(self) -> None:
        pass


async def test_a_held_buffered_request_extends_envoys_timeout_before_it_is_routed() -> None:
    h = Harness()
    h.director.flow_gate = gate = HoldingGate()
    s = h.stream()
    await s.on_message(headers_msg(buffered=True))
    replies = s.route(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    wait_s = min(gate.held_s + MESSAGE_TIMEOUT_S, MAX_MESSAGE_TIMEOUT_S)
    assert await anext(replies) == extend_timeout(wait_s)  # sent while the request waits
    assert h.in_flight() == 0
    gate.release.set()
    (reply,) = [reply async for reply in replies]
    assert routed_destination(reply).startswith("10.0.0.1:") and h.in_flight() == 1


async def test_a_held_request_whose_stream_goes_away_is_withdrawn() -> None:
    """Envoy reset the stream while the request waited (the gRPC server stops iterating)."""
    h = Harness()
    h.director.flow_gate = gate = HoldingGate()
    s = h.stream()
    await s.on_message(headers_msg(buffered=True))
    replies = s.route(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    await anext(replies)
    await replies.aclose()
    s.close()
    assert gate.withdrawn and h.in_flight() == 0


async def test_a_held_full_duplex_request_sends_nothing_until_it_is_routed() -> None:
    """Envoy times no message of a FULL_DUPLEX_STREAMED body: the headers reply, with the
    destination, is the first."""
    h = Harness()
    h.director.flow_gate = gate = HoldingGate()
    s = h.stream()
    await s.on_message(headers_msg())
    answer = asyncio.ensure_future(s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True)))
    await asyncio.sleep(0.01)
    assert not answer.done()
    gate.release.set()
    replies = await answer
    assert routed_destination(replies[0]).startswith("10.0.0.1:")
    assert not any(r.HasField("override_message_timeout") for r in replies)


async def test_buffered_body_followed_by_trailers_is_routed_at_once() -> None:
    # A buffered body is whole in one message; with trailers to follow it has no end_of_stream.
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg(buffered=True))
    (reply,) = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=False))
    assert reply.HasField("request_body") and routed_destination(reply).startswith("10.0.0.1:")
    assert h.in_flight() == 1


@pytest.mark.parametrize(
    ("given", "kept"), [("abc-123", True), ("x" * 500, False), ("a b", False), ("", False)]
)
async def test_only_plain_request_ids_are_kept(given: str, kept: bool) -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg(**{"x-request-id": given}))
    (reply, _) = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    mutation = reply.request_headers.response.header_mutation.set_headers
    request_id = {o.header.key: o.header.raw_value.decode() for o in mutation}["x-request-id"]
    assert (request_id == given) is kept and len(request_id) <= 128


async def test_debug_header_reports_the_routing_decision_in_the_response() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg(**{"x-llm-epp-debug": "true"}))
    replies = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    (reply,) = await s.on_message(response_headers_msg())
    added = {
        o.header.key: o.header.raw_value.decode()
        for o in reply.response_headers.response.header_mutation.set_headers
    }
    target = routed_destination(replies[0])
    assert added["x-llm-epp-endpoint"] == ("e0" if target.endswith(":8000") else "e1")
    plain = h.stream()
    await plain.on_message(headers_msg())
    await plain.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    (quiet,) = await plain.on_message(response_headers_msg())
    assert not quiet.response_headers.HasField("response")


class TraceContext(LifecycleObserver):
    """Adds a fixed trace context to every forwarded request."""

    def upstream_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        return {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}


@pytest.mark.parametrize("buffered", [False, True])
async def test_observers_headers_go_on_to_the_engine_and_the_decision_trace_back(buffered: bool) -> None:
    h = Harness(observers=[TraceContext(), DecisionLog()])
    s = h.stream()
    await s.on_message(headers_msg(buffered=buffered, **{"x-llm-epp-debug": "true"}))
    replies = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    common = replies[0].request_body.response if buffered else replies[0].request_headers.response
    upstream = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    assert upstream["traceparent"] == f"00-{'1' * 32}-{'2' * 16}-01"
    (reply,) = await s.on_message(response_headers_msg())
    added = {
        o.header.key: o.header.raw_value.decode()
        for o in reply.response_headers.response.header_mutation.set_headers
    }
    decision = json.loads(added["x-llm-epp-decision"])
    assert decision["picked"] == added["x-llm-epp-endpoint"] and decision["candidates"] == 2
    assert set(decision["scores"]) == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}


async def test_non_streamed_requests_skip_the_response_body_and_finish_on_headers() -> None:
    h = Harness()
    s = h.stream()
    await s.on_message(headers_msg())
    replies = await s.on_message(body_msg(json.dumps({**COMPLETION, "stream": False}).encode(), eos=True))
    assert not replies[0].HasField("mode_override")  # Envoy ignores one outside a headers reply
    h.clock.advance(0.25)
    (reply,) = await s.on_message(response_headers_msg(200, "application/json"))
    assert reply.HasField("response_headers") and reply.HasField("mode_override")
    assert reply.mode_override.response_body_mode == ProcessingMode.NONE
    assert reply.mode_override.response_header_mode == ProcessingMode.DEFAULT  # the rest unchanged
    # Done: the server sends this reply, then closes the stream, which settles the books.
    assert s.done and h.in_flight() == 1
    s.close()
    assert h.in_flight() == 0
    labels = {"model_name": "tiny", "target_model_name": "tiny"}
    assert h.metric("inference_objective_request_duration_seconds_sum", **labels) == pytest.approx(0.25)
    assert h.metric("inference_objective_output_tokens_count", **labels) == 0  # tokens unknown, not zero

    streamed = h.stream()
    await streamed.on_message(headers_msg())
    await streamed.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    (reply,) = await streamed.on_message(response_headers_msg())
    assert not reply.HasField("mode_override") and streamed.phase is Phase.RESPONSE
    streamed.close()

    debug = h.stream()  # the debug headers and the skip go in the same reply
    await debug.on_message(headers_msg(**{"x-llm-epp-debug": "true"}))
    await debug.on_message(body_msg(json.dumps({**COMPLETION, "stream": False}).encode(), eos=True))
    (reply,) = await debug.on_message(response_headers_msg(200, "application/json"))
    added = {o.header.key for o in reply.response_headers.response.header_mutation.set_headers}
    assert "x-llm-epp-endpoint" in added and reply.mode_override.response_body_mode == ProcessingMode.NONE
    debug.close()

    bodyless = h.stream()  # a response without a body has nothing to skip
    await bodyless.on_message(headers_msg())
    await bodyless.on_message(body_msg(json.dumps({**COMPLETION, "stream": False}).encode(), eos=True))
    (reply,) = await bodyless.on_message(response_headers_msg(204, "application/json", eos=True))
    assert not reply.HasField("mode_override") and bodyless.done
    bodyless.close()
    assert h.in_flight() == 0


def epp_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("epp.")]


def assert_error_reply(reply, status: int) -> dict:
    immediate = reply.immediate_response
    assert immediate.status.code == status
    assert header_dict_of(immediate)["content-type"] == "application/json"
    error = json.loads(immediate.body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_bodies_are_400s_logged_in_one_line(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness()
    path, body = HOSTILE[case]
    s = h.stream()
    caplog.set_level(logging.INFO)
    await s.on_message(headers_msg(path, **{"x-request-id": "hostile-1"}))
    (reply,) = await s.on_message(body_msg(body, eos=True))
    assert_error_reply(reply, 400)
    s.close()
    (record,) = epp_records(caplog)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "hostile-1" in record.getMessage() and "Traceback" not in caplog.text
    assert h.in_flight() == 0


async def test_a_bug_while_the_request_is_ours_is_a_json_500_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness()

    async def broken(*args: object) -> AsyncIterator[RequestEvent]:
        raise RuntimeError("scheduler bug")
        yield  # an async generator, as ``RequestHandle.schedule`` is

    monkeypatch.setattr(RequestHandle, "schedule", broken)
    s = h.stream()
    await s.on_message(headers_msg(**{"x-request-id": "bug-1"}))
    (reply,) = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    error = assert_error_reply(reply, 500)
    assert error["type"] == "InternalServerError" and "scheduler bug" not in error["message"]
    assert await s.on_message(response_headers_msg()) == [CONTINUE_RESPONSE_HEADERS]
    s.close()
    (record,) = epp_records(caplog)
    assert record.levelno == logging.ERROR and record.exc_info is None
    assert "bug-1" in record.getMessage() and "RuntimeError: scheduler bug" in record.getMessage()
    monkeypatch.undo()
    routed = h.stream()
    await routed.on_message(headers_msg())
    assert routed_destination(
        (await routed.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True)))[0]
    )


async def test_a_bug_after_routing_lets_the_response_through_and_frees_the_endpoint(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness()

    def broken(*args: object) -> None:
        raise KeyError("meter bug")

    monkeypatch.setattr(RequestHandle, "response_body", broken)
    s = h.stream()
    await s.on_message(headers_msg())
    await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    await s.on_message(response_headers_msg())
    assert h.in_flight() == 1
    chunk = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert await s.on_message(response_body_msg(chunk, eos=False)) == [CONTINUE_RESPONSE_BODY]
    assert await s.on_message(response_body_msg(chunk, eos=True)) == [CONTINUE_RESPONSE_BODY]
    s.close()
    assert h.in_flight() == 0
    (record,) = epp_records(caplog)
    assert record.levelno == logging.ERROR and "KeyError" in record.getMessage() and record.exc_info is None


@pytest.mark.parametrize("learned", [True, False])
async def test_a_10_mib_prompt_is_refused_without_tokenizing_it(learned: bool) -> None:
    tokenizer = CountingTokenizer()
    h = Harness(max_body=16 << 20, tokenizer=tokenizer, default_max_model_len=None if learned else 2048)
    if learned:  # as the scraper records it from each engine's /v1/models
        h.store.record_max_model_len("e0", 1024)
        h.store.record_max_model_len("e1", 2048)
    s = h.stream()
    body = json.dumps({**COMPLETION, "prompt": "hello world " * (TEN_MIB // 12)}).encode()
    await s.on_message(headers_msg())
    await s.on_message(body_msg(body[: len(body) // 2], eos=False))
    (reply,) = await s.on_message(body_msg(body[len(body) // 2 :], eos=True))
    error = assert_error_reply(reply, 400)
    assert error["param"] == "input_text" and "maximum context length is 2048 tokens" in error["message"]
    assert tokenizer.encoded == []


async def test_a_long_body_extending_a_seen_prompt_is_parsed_on_the_loop_a_new_one_in_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offloaded: list[str] = []

    async def to_thread(function, *args, **kwargs):
        offloaded.append(function.__name__)
        return function(*args, **kwargs)

    monkeypatch.setattr(handle_module.asyncio, "to_thread", to_thread)
    tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=64 << 20)
    h = Harness(tokenizer=tokenizer)
    seen = "A long tool output line. " * 4_000  # over the worker-thread bounds, body and text
    assert len(seen) > max(GIL_FREE_CHARS, OFFLOAD_BODY_BYTES)

    async def route(prompt: str) -> None:
        s = h.stream()
        await s.on_message(headers_msg(buffered=True))
        (reply,) = await s.on_message(body_msg(json.dumps({**COMPLETION, "prompt": prompt}).encode(), True))
        assert routed_destination(reply).startswith("10.0.0.1:")
        assert s.handle is not None and s.handle.request is not None
        assert s.handle.request.prompt_token_ids == ModelTokenizer(TINY_MODEL_DIR).encode(prompt)
        s.close()

    await route(seen)
    assert offloaded == ["parse_openai_request"]  # all of it to tokenize: in a worker thread
    await route(seen + "And a short new turn.")
    assert offloaded == ["parse_openai_request"]  # only the new words: on the loop
    await route(seen + "A long new tool output. " * 1_000)
    assert offloaded == ["parse_openai_request"] * 2


def _classify(replies: list) -> list[str]:
    kinds = []
    for reply in replies:
        if reply.HasField("immediate_response"):
            status = reply.immediate_response.status.code
            error = json.loads(reply.immediate_response.body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
            kinds.append(f"answered {status}")
        elif LB_METADATA_NAMESPACE in reply.dynamic_metadata.fields:
            kinds.append("routed")
    return kinds


# Header values as Envoy hands them over: any UTF-8.
HINT_HEADERS = st.dictionaries(
    st.sampled_from(
        ["x-slo-ttft-ms", "x-llm-d-slo-tpot-ms", "x-priority", "x-llm-epp-debug", "x-request-id"]
    ),
    st.text(st.characters(codec="utf-8"), max_size=8)
    | st.sampled_from(["250", "-1", "nan", "1_000", "true", "١"]),
    max_size=3,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=PATHS,
    extra=HINT_HEADERS,
    body=request_bodies(),
    cuts=st.lists(st.integers(0, 200), max_size=3),
    buffered=st.booleans(),
    end_with_trailers=st.booleans(),
    status=st.sampled_from([200, 400, 500, 503]),
    data=st.data(),
)
def test_any_exchange_is_routed_or_answered_4xx(
    path: str,
    extra: dict[str, str],
    body: bytes,
    cuts: list[int],
    buffered: bool,
    end_with_trailers: bool,
    status: int,
    data: st.DataObject,
) -> None:
    h = Harness(default_max_model_len=data.draw(st.none() | st.integers(1, 64)))
    bounds = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    chunks = [body[a:b] for a, b in itertools.pairwise(bounds)] or [b""]

    async def exchange() -> list[str]:
        s = h.stream()
        kinds = _classify(await s.on_message(headers_msg(path, buffered=buffered, **extra)))
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1 and not end_with_trailers
            kinds += _classify(await s.on_message(body_msg(chunk, eos=last)))
        if end_with_trailers:
            kinds += _classify(await s.on_message(ProcessingRequest(request_trailers=HttpTrailers())))
        kinds += _classify(await s.on_message(response_headers_msg(status)))
        kinds += _classify(await s.on_message(response_body_msg(b"data: [DONE]\n\n", eos=True)))
        s.close()
        return kinds

    (decision,) = asyncio.run(exchange())
    assert decision == "routed" or decision in {"answered 400", "answered 413"}
    assert h.in_flight() == 0
