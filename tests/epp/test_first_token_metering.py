"""First-token metering: streams read to their first token, finished from the access log."""

from __future__ import annotations

import json
import random

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import AccessLogType, HTTPAccessLogEntry
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from google.protobuf.wrappers_pb2 import UInt32Value
from hypothesis import given
from hypothesis import strategies as st

from epp.extproc.access_log import log_entry
from epp.extproc.messages import RESPONSE_CODE_ATTRIBUTE, SERVED_BY_ATTRIBUTE
from epp.extproc.stream import Phase
from epp.requestcontrol.completion_log import (
    BytesPerToken,
    DecodeRates,
    HandOffs,
    LogEntry,
    MeteringPlan,
    MeteringSettings,
    finish_time,
)
from tests.epp.extproc_harness import (
    Harness,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    routed_destination,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stream": True}
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
LABELS = {"model_name": "tiny", "target_model_name": "tiny"}


def stream_bytes(tokens: int) -> int:
    return len(ROLE) + tokens * len(TOKEN) + len(FINISH)


# --- the pure parts ---------------------------------------------------------------------


@given(
    overhead=st.integers(0, 2_000),
    per_token=st.integers(20, 400),
    lengths=st.lists(st.integers(1, 5_000), min_size=2, max_size=20).filter(lambda ls: len(set(ls)) > 1),
    probe=st.integers(1, 20_000),
)
def test_bytes_per_token_recovers_a_streams_overhead_and_per_token_size(
    overhead: int, per_token: int, lengths: list[int], probe: int
) -> None:
    meter = BytesPerToken()
    for n in lengths:
        meter.observe("m", overhead + per_token * n, n)
    line = meter.line("m")
    assert line is not None
    assert line[0] == pytest.approx(overhead, abs=1e-3) and line[1] == pytest.approx(per_token)
    assert meter.tokens("m", overhead + per_token * probe) == probe


def test_bytes_per_token_knows_nothing_before_a_stream_and_uses_the_ratio_for_one_length() -> None:
    meter = BytesPerToken()
    assert meter.tokens("m", 1000) is None
    meter.observe("m", 1000, 10)
    meter.observe("m", 1000, 10)
    assert meter.line("m") == (0.0, 100.0) and meter.tokens("m", 550) == 6
    assert meter.tokens("other", 550) is None
    meter.observe("m", 0, 5)  # nothing learned from an empty or a tokenless stream
    meter.observe("m", 500, 0)
    assert meter.line("m") == (0.0, 100.0)


def test_decode_rates_follow_each_endpoints_recent_tpot() -> None:
    rates = DecodeRates(weight=0.5)
    assert rates.tokens("e0", 1.0, None) is None
    rates.observe("e0", 0.02)
    assert rates.tokens("e0", 0.0, None) == 1 and rates.tokens("e0", 1.0, None) == 51
    assert rates.tokens("e0", 1.0, cap=30) == 30 and rates.tokens("e0", -1.0, None) == 1
    rates.observe("e0", 0.04)  # halfway to the newest
    rates.observe("e0", 0.0)  # no TPOT: ignored
    assert rates.tokens("e0", 0.3, None) == 11 and rates.tokens("e1", 0.3, None) is None


def test_the_plan_meters_each_models_first_streams_then_one_in_n() -> None:
    plan = MeteringPlan(MeteringSettings("first-token", sample_every=5, calibration_streams=2))
    picks = [plan.meter_fully("a") for _ in range(16)]
    assert picks == [True, True, False, False, False, True] + [False] * 4 + [True] + [False] * 4 + [True]
    assert plan.meter_fully("b")  # each model calibrates on its own
    full = MeteringPlan(MeteringSettings("full"))
    assert all(full.meter_fully("a") for _ in range(10))


def test_hand_offs_expire_when_silent_and_an_intermediate_entry_keeps_them() -> None:
    waiting: HandOffs[str] = HandOffs(silence_s=10.0)
    waiting.add("r1", "one", now=0.0)
    waiting.add("r2", "two", now=0.0)
    assert waiting.heard("r2", now=8.0) == "two" and waiting.heard("nope", now=8.0) is None
    assert list(waiting.expired(9.9)) == []
    assert list(waiting.expired(10.0)) == ["one"]
    assert "r1" not in waiting and len(waiting) == 1
    assert list(waiting.expired(17.9)) == [] and list(waiting.expired(18.0)) == ["two"]
    assert waiting.pop("r2") is None


def test_an_entry_kept_before_its_hand_off_is_given_back_by_it_or_dropped() -> None:
    waiting: HandOffs[str] = HandOffs(silence_s=10.0)
    early = LogEntry("r1", 200, 100, 0.1, "complete")
    waiting.keep_early(early)
    assert len(waiting) == 0 and waiting.pop("r1") is None
    assert waiting.add("r1", "one", now=0.0) is early
    assert waiting.add("r2", "two", now=0.0) is None
    waiting.keep_early(LogEntry("r3", 200, 100, 0.1, "complete"))
    assert waiting.drop_early("r3") is not None and waiting.drop_early("r3") is None
    assert waiting.add("r3", "three", now=0.0) is None


def test_the_finish_time_is_placed_from_the_request_start_and_kept_in_bounds() -> None:
    entry = LogEntry("r", 200, 100, last_upstream_byte_s=2.5, ended="complete")
    assert finish_time(10.0, 10.4, entry, now=20.0) == 12.5
    assert finish_time(10.0, 13.0, entry, now=20.0) == 13.0  # never before the first token
    assert finish_time(10.0, 10.4, entry, now=12.0) == 12.0  # never after now
    none = LogEntry("r", 0, 0, last_upstream_byte_s=None, ended="client_gone")
    assert finish_time(10.0, 10.4, none, now=11.0) == 11.0 and not none.completed


def _envoy_entry(**flags: bool) -> HTTPAccessLogEntry:
    entry = HTTPAccessLogEntry()
    entry.request.request_id = "envoys-own"
    entry.request.request_headers["x-request-id"] = "forwarded-id"
    entry.response.response_code.CopyFrom(UInt32Value(value=200))
    entry.response.response_body_bytes = 4321
    entry.common_properties.time_to_last_upstream_rx_byte.FromNanoseconds(1_500_000_000)
    for name, value in flags.items():
        setattr(entry.common_properties.response_flags, name, value)
    return entry


@pytest.mark.parametrize(
    ("flags", "ended"),
    [
        ({}, "complete"),
        ({"downstream_connection_termination": True}, "client_gone"),
        ({"downstream_remote_reset": True}, "client_gone"),
        ({"upstream_remote_reset": True}, "upstream_reset"),
        ({"upstream_connection_termination": True}, "upstream_reset"),
        ({"stream_idle_timeout": True}, "failed"),
    ],
)
def test_envoys_entry_is_read_into_what_the_director_needs(flags: dict[str, bool], ended: str) -> None:
    entry = log_entry(_envoy_entry(**flags))
    assert entry == LogEntry("forwarded-id", 200, 4321, 1.5, ended)  # type: ignore[arg-type]
    assert entry.completed == (ended == "complete")


def test_a_client_that_hung_up_on_done_got_the_whole_answer() -> None:
    raw = _envoy_entry(downstream_connection_termination=True)
    raw.common_properties.metadata.filter_metadata["llm_epp"].update({"sse_done": True})
    assert log_entry(raw).ended == "complete"


def test_a_periodic_entry_is_intermediate_and_envoys_id_is_the_fallback() -> None:
    raw = _envoy_entry()
    del raw.request.request_headers["x-request-id"]
    raw.common_properties.access_log_type = AccessLogType.DownstreamPeriodic
    raw.common_properties.ClearField("time_to_last_upstream_rx_byte")
    entry = log_entry(raw)
    assert entry.intermediate and entry.request_id == "envoys-own" and entry.last_upstream_byte_s is None


def test_the_upstream_that_answered_is_read_from_the_entry() -> None:
    raw = _envoy_entry()
    assert log_entry(raw).served_by is None  # no upstream answered
    raw.common_properties.upstream_remote_address.socket_address.address = "10.0.0.7"
    raw.common_properties.upstream_remote_address.socket_address.port_value = 8000
    assert log_entry(raw).served_by == "10.0.0.7:8000"


# --- the director and the stream ----------------------------------------------------------


def first_token_harness(config: str = "ray-kv-aware") -> Harness:
    """Each model's first two streams metered in full, then one in four."""
    settings = MeteringSettings("first-token", sample_every=4, calibration_streams=2, silence_s=30.0)
    return Harness(config=config, metering=settings)


async def send_stream(
    h: Harness,
    request_id: str,
    tokens: int,
    *,
    hang_up_after: int | None = None,
    headerless: dict[str, object] | None = None,
    close: bool = True,
):
    """One streamed chat request, its answer fed chunk by chunk until the stream says it is done
    (or the client hangs up); returns the stream and how many answer chunks it read. With
    ``headerless`` no response headers come and the first chunk carries those attributes; with
    ``close`` False the stream's end has not reached the EPP yet."""
    s = h.stream()
    await s.on_message(headers_msg("/v1/chat/completions", buffered=True, **{"x-request-id": request_id}))
    await s.on_message(body_msg(json.dumps(CHAT).encode(), eos=True))
    h.clock.advance(0.2)
    if headerless is None:
        await s.on_message(response_headers_msg())
    chunks = [ROLE, *[TOKEN] * tokens, FINISH]
    read = 0
    for i, chunk in enumerate(chunks):
        if s.done or (hang_up_after is not None and i >= hang_up_after):
            break
        attributes = headerless if i == 0 else None
        await s.on_message(response_body_msg(chunk, eos=i == len(chunks) - 1, attributes=attributes))
        read += 1
        h.clock.advance(0.01)
    if close:
        s.close()
    return s, read


async def calibrate(h: Harness) -> None:
    """The model's first two streams, of 10 and 30 tokens: read to their end."""
    for tokens in (10, 30):
        _, read = await send_stream(h, f"calibrate-{tokens}", tokens)
        assert read == tokens + 2
    assert h.in_flight() == 0


async def test_a_handed_off_stream_ends_at_its_first_token_and_its_log_entry_finishes_it() -> None:
    h = first_token_harness()
    await calibrate(h)
    s, read = await send_stream(h, "r1", 100)
    assert read == 2 and s.phase is Phase.DONE  # the role, then the first token
    assert h.in_flight() == 1 and h.tracker is not None and h.tracker.in_flight() == 1
    assert h.metric("llm_epp_handed_off_requests") == 1
    h.clock.advance(2.0)
    received_at = h.clock() - 2.0 - 2 * 0.01 - 0.2
    tpot_before = h.metric("inference_objective_request_tpot_seconds_sum", **LABELS)
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(100), 0.2 + 1.5, "complete"))
    assert h.in_flight() == 0 and h.tracker.in_flight() == 0
    assert h.metric("llm_epp_handed_off_requests") == 0
    assert h.metric("llm_epp_access_log_entries_total", kind="final") == 1
    assert h.metric("inference_objective_output_tokens_sum", **LABELS) == 10 + 30 + 100
    # TPOT: from the first token (0.21 s after the start) to the last byte (1.7 s after the start,
    # placed from received_at), over the 99 tokens after the first.
    tpot = h.metric("inference_objective_request_tpot_seconds_sum", **LABELS) - tpot_before
    assert tpot == pytest.approx((1.7 - 0.21) / 99, rel=1e-6)
    assert h.metric("llm_epp_access_log_lag_seconds_sum") == pytest.approx(h.clock() - received_at - 1.7)
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="aborted") == 0


async def test_an_entry_that_outruns_its_streams_end_finishes_the_request_at_the_hand_off() -> None:
    """Under load the EPP can read Envoy's entry for a short answer before its own stream's end:
    the entry waits for the hand-off instead of being taken for another replica's request (which
    left the booking until the silence expired it, 30 s later)."""
    h = first_token_harness()
    await calibrate(h)
    s, read = await send_stream(h, "r1", 5, close=False)
    assert read == 2 and h.in_flight() == 1
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(5), 0.3, "complete"))
    assert h.in_flight() == 1  # the stream is not over yet
    s.close()
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0
    assert h.metric("llm_epp_access_log_entries_total", kind="final") == 1
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="aborted") == 0
    assert h.metric("inference_objective_output_tokens_sum", **LABELS) == 10 + 30 + 5


async def test_an_early_entry_for_a_stream_read_to_its_end_is_dropped_with_it() -> None:
    h = first_token_harness()
    s, read = await send_stream(h, "whole", 10, close=False)  # a calibration stream: read whole
    assert read == 12
    h.director.log_entry(LogEntry("whole", 200, stream_bytes(10), 0.3, "complete"))
    assert h.metric("llm_epp_access_log_entries_total", kind="unknown") == 0  # kept for the end
    s.close()
    assert h.in_flight() == 0
    assert h.metric("inference_objective_request_duration_seconds_count", **LABELS) == 1
    assert h.metric("llm_epp_access_log_entries_total", kind="unknown") == 1
    h.director.log_entry(LogEntry("whole", 200, stream_bytes(10), 0.3, "complete"))  # the id is free
    assert h.metric("llm_epp_access_log_entries_total", kind="unknown") == 2


async def test_log_entries_are_the_serving_endpoints_signs_of_life() -> None:
    """A handed-off stream's tokens no longer reach the EPP: its log entries stand in for them,
    so that a busy engine whose /metrics answers late is not taken for a stalled one."""
    h = first_token_harness()
    await calibrate(h)
    await send_stream(h, "r1", 300)
    [serving] = [s.name for s in h.store.all() if s.in_flight]
    first_token_life = h.store.alive_at(serving)
    h.clock.advance(5.0)
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(150), 4.0, "complete", intermediate=True))
    assert h.store.alive_at(serving) == h.clock() > first_token_life
    h.clock.advance(5.0)
    received_at = h.clock() - 10.0 - 2 * 0.01 - 0.2
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(300), 9.0, "complete"))
    assert h.store.alive_at(serving) == pytest.approx(received_at + 9.0)


async def test_a_client_reusing_a_live_request_id_gets_a_new_one_and_nothing_leaks() -> None:
    h = first_token_harness()
    await calibrate(h)
    first, _ = await send_stream(h, "same", 50)
    second, _ = await send_stream(h, "same", 50)  # the first is still waiting for its entry
    assert first.handle is not None and second.handle is not None
    assert first.handle.request_id == "same" and second.handle.request_id != "same"
    for handle in (first.handle, second.handle):
        h.director.log_entry(LogEntry(handle.request_id, 200, stream_bytes(50), 0.5, "complete"))
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0
    third, _ = await send_stream(h, "same", 5, hang_up_after=1)  # the id is free again
    assert third.handle is not None and third.handle.request_id == "same"


async def test_one_stream_in_n_is_still_metered_to_its_end() -> None:
    h = first_token_harness()
    reads = [(await send_stream(h, f"r{i}", 10))[1] for i in range(9)]
    assert reads == [12, 12, 2, 2, 12, 2, 2, 2, 12]
    assert h.in_flight() == 5  # the handed-off ones wait for their log entries


async def test_a_client_gone_after_the_hand_off_is_an_error_and_releases_everything() -> None:
    h = first_token_harness()
    await calibrate(h)
    await send_stream(h, "r1", 50)
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(7), 0.5, "client_gone"))
    assert h.in_flight() == 0 and h.tracker is not None and h.tracker.in_flight() == 0
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="client_gone") == 1
    assert h.metric("inference_objective_request_duration_seconds_count", **LABELS) == 2  # calibration


async def test_a_stream_cancelled_before_its_first_token_is_finished_by_the_stream() -> None:
    h = first_token_harness()
    await calibrate(h)
    await send_stream(h, "r1", 50, hang_up_after=1)  # the role chunk only
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="aborted") == 1


async def test_silent_hand_offs_expire_and_intermediate_entries_keep_them_and_move_progress() -> None:
    h = first_token_harness()
    await calibrate(h)
    await send_stream(h, "quiet", 50)
    await send_stream(h, "long", 500)
    assert h.tracker is not None
    decode_before = sum(h.tracker.load(e).decode_tokens for e in (s.name for s in h.store.all()))
    h.clock.advance(20.0)
    h.director.log_entry(LogEntry("long", 200, stream_bytes(200), 20.0, "complete", intermediate=True))
    decode_after = sum(h.tracker.load(e).decode_tokens for e in (s.name for s in h.store.all()))
    assert decode_after - decode_before == 200 - 1  # the first token was counted at first token
    assert h.director.expire_handoffs() == 0
    h.clock.advance(10.0)  # "quiet" was last heard of 30 s ago, "long" 10 s ago
    assert h.director.expire_handoffs() == 1 and h.in_flight() == 1
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="unlogged") == 1
    h.clock.advance(20.0)
    assert h.director.expire_handoffs() == 1 and h.in_flight() == 0
    assert h.metric("llm_epp_handed_off_expired_total") == 2


async def test_handed_off_decode_progress_moves_on_at_the_endpoints_recent_tpot() -> None:
    h = first_token_harness()
    await calibrate(h)  # two streams, 0.01 s a token, on whichever endpoints they went to
    assert h.tracker is not None
    for i in range(4):
        await send_stream(h, f"r{i}", 500)
    waiting = [s.name for s in h.store.all() if s.in_flight]

    def decode() -> int:
        return sum(h.tracker.load(name).decode_tokens for name in waiting)  # type: ignore[union-attr]

    before = decode()
    h.clock.advance(0.5)
    h.director.estimate_progress()
    grown = decode() - before
    rated = [n for n in waiting if h.director.decode_rates.tokens(n, 0.0, None) is not None]
    assert rated, "the calibration streams gave an endpoint its TPOT"
    # ~0.5 s / 0.01 s = 50 tokens more for each handed-off request on a rated endpoint.
    assert 40 * len(rated) <= grown <= 60 * 4, grown
    h.director.estimate_progress()  # no time passed: nothing moves
    assert decode() - before == grown


async def test_entries_for_requests_not_handed_off_are_counted_and_change_nothing() -> None:
    h = first_token_harness()
    await calibrate(h)  # finished by their streams already
    h.director.log_entry(LogEntry("calibrate-10", 200, stream_bytes(10), 0.3, "complete"))
    h.director.log_entry(LogEntry("someone-elses", 200, 10, 0.3, "complete", intermediate=True))
    assert h.metric("llm_epp_access_log_entries_total", kind="unknown") == 2
    assert h.metric("inference_objective_request_duration_seconds_count", **LABELS) == 2


@pytest.mark.parametrize("seed", range(3))
async def test_any_mix_of_endings_leaves_no_booking_behind(seed: int) -> None:
    rng = random.Random(seed)
    h = first_token_harness()
    for i in range(60):
        await send_stream(h, f"r{i}", rng.randint(1, 40), hang_up_after=rng.choice([None, None, 1, 3]))
    for i in rng.sample(range(60), 40):
        ended = rng.choice(["complete", "client_gone", "upstream_reset"])
        h.director.log_entry(LogEntry(f"r{i}", 200, rng.randint(0, 5000), 0.5, ended))
    h.clock.advance(31.0)
    h.director.expire_handoffs()
    assert h.in_flight() == 0 and h.tracker is not None and h.tracker.in_flight() == 0
    assert h.metric("llm_epp_handed_off_requests") == 0
    assert h.metric("inference_objective_running_requests", model_name="tiny") == 0


COMPLETION = {"model": "tiny", "prompt": "Hello there", "max_tokens": 32}


async def send_unstreamed(h: Harness, request_id: str, **headers: str):
    """One non-streamed completion, up to its routing; returns the stream and the body's replies."""
    s = h.stream()
    await s.on_message(headers_msg(buffered=True, **{"x-request-id": request_id, **headers}))
    replies = await s.on_message(body_msg(json.dumps(COMPLETION).encode(), eos=True))
    return s, replies


async def test_a_non_streamed_answer_is_handed_off_at_its_routing_and_its_entry_finishes_it() -> None:
    h = first_token_harness()
    s, replies = await send_unstreamed(h, "n1")
    assert len(replies) == 1 and replies[0].HasField("request_body")  # routed
    assert s.done  # no response message: the server ends the stream here
    s.close()
    assert h.in_flight() == 1 and h.metric("llm_epp_handed_off_requests") == 1
    h.clock.advance(3.0)
    h.director.estimate_progress()  # nothing to estimate for an answer not streamed
    h.director.log_entry(LogEntry("n1", 200, 900, 2.5, "complete"))
    assert h.in_flight() == 0 and h.tracker is not None and h.tracker.in_flight() == 0
    assert h.metric("inference_objective_request_duration_seconds_sum", **LABELS) == pytest.approx(2.5)
    assert h.metric("inference_objective_output_tokens_count", **LABELS) == 0  # bytes say nothing here


async def test_a_non_streamed_answers_5xx_entry_marks_its_endpoint_failed() -> None:
    h = first_token_harness()
    s, _ = await send_unstreamed(h, "n1")
    s.close()
    assert s.handle is not None and s.handle.routed is not None
    picked = s.handle.routed.endpoint_name
    h.director.log_entry(LogEntry("n1", 503, 60, 0.1, "complete"))
    assert h.metric("llm_epp_upstream_failures_total", model_server_pod=picked) == 1
    assert h.in_flight() == 0
    assert h.metric("inference_objective_request_error_total", **LABELS, error_code="503") == 1


async def test_a_non_streamed_answer_served_by_a_fallback_is_rebooked_there_by_its_entry() -> None:
    h = first_token_harness()
    s, replies = await send_unstreamed(h, "n1")
    s.close()
    picked = routed_destination(replies[0])
    other = next(e for e in h.store.all() if e.endpoint.hostport != picked)
    received_at = h.clock()
    h.clock.advance(2.0)
    h.director.log_entry(LogEntry("n1", 200, 900, 1.0, "complete", served_by=other.endpoint.hostport))
    assert h.store.alive_at(other.name) == pytest.approx(received_at + 1.0)  # its answer came
    assert h.in_flight() == 0 and h.tracker is not None and h.tracker.in_flight() == 0


@pytest.mark.parametrize(
    ("metering", "headers"),
    [("full", {}), ("first-token", {"x-llm-epp-debug": "true"})],
)
async def test_a_non_streamed_answer_waits_for_its_headers_in_full_metering_or_for_a_trace(
    metering: str, headers: dict[str, str]
) -> None:
    h = Harness(config="ray-kv-aware", metering=MeteringSettings(metering))  # type: ignore[arg-type]
    s, _ = await send_unstreamed(h, "n1", **headers)
    assert not s.done
    await s.on_message(response_headers_msg(content_type="application/json", eos=True))
    assert s.done
    s.close()
    assert h.in_flight() == 0 and h.metric("llm_epp_handed_off_requests") == 0


# --- no response headers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("metering", "headers", "skipped"),
    [("first-token", {}, True), ("first-token", {"x-llm-epp-debug": "true"}, False), ("full", {}, False)],
)
async def test_first_token_metering_asks_for_no_response_headers_unless_a_trace_wants_them(
    metering: str, headers: dict[str, str], skipped: bool
) -> None:
    h = Harness(config="ray-kv-aware", metering=MeteringSettings(metering))  # type: ignore[arg-type]
    [reply] = await h.stream().on_message(headers_msg("/v1/chat/completions", buffered=True, **headers))
    assert reply.HasField("request_headers")
    mode = reply.mode_override
    assert (mode.response_header_mode == ProcessingMode.SKIP) is skipped
    if skipped:  # an override replaces the whole mode: the rest is the gateway's own
        assert (mode.request_body_mode, mode.response_body_mode) == (
            ProcessingMode.BUFFERED,
            ProcessingMode.STREAMED,
        )


async def test_a_stream_without_response_headers_takes_its_status_and_server_from_its_first_chunk() -> None:
    h = first_token_harness()
    for tokens in (10, 30):  # the calibration streams, read to their end without headers too
        _, read = await send_stream(h, f"c{tokens}", tokens, headerless={RESPONSE_CODE_ATTRIBUTE: 200})
        assert read == tokens + 2
    s = h.stream()
    await s.on_message(headers_msg("/v1/chat/completions", buffered=True, **{"x-request-id": "r1"}))
    [routed] = await s.on_message(body_msg(json.dumps(CHAT).encode(), eos=True))
    other = next(e for e in h.store.all() if e.endpoint.hostport != routed_destination(routed))
    served = {RESPONSE_CODE_ATTRIBUTE: 200, SERVED_BY_ATTRIBUTE: other.endpoint.hostport}
    await s.on_message(response_body_msg(ROLE, eos=False, attributes=served))
    await s.on_message(response_body_msg(TOKEN, eos=False))
    assert s.done  # handed off at the first token, on the endpoint that answered
    s.close()
    assert other.in_flight == 1 and h.in_flight() == 1
    h.director.log_entry(LogEntry("r1", 200, stream_bytes(20), 1.0, "complete"))
    assert h.in_flight() == 0 and h.metric("inference_objective_output_tokens_sum", **LABELS) == 10 + 30 + 20


@pytest.mark.parametrize(("attributes", "failed"), [({RESPONSE_CODE_ATTRIBUTE: 503}, 1), ({}, 0)])
async def test_a_first_chunk_without_headers_says_a_5xx_by_its_attribute_and_an_sse_event_says_200(
    attributes: dict[str, object], failed: int
) -> None:
    h = first_token_harness()
    s = h.stream()
    await s.on_message(headers_msg("/v1/chat/completions", buffered=True, **{"x-request-id": "r1"}))
    [routed] = await s.on_message(body_msg(json.dumps(CHAT).encode(), eos=True))
    picked = next(e.name for e in h.store.all() if e.endpoint.hostport == routed_destination(routed))
    await s.on_message(response_body_msg(ROLE, eos=False, attributes=attributes))
    assert h.metric("llm_epp_upstream_failures_total", model_server_pod=picked) == failed
    assert s.handle is not None and s.handle.status == (503 if failed else 200)
