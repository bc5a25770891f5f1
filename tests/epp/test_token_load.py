from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.extproc.stream import ExtProcStream
from epp.load.output_length import ExpectedOutput, OutputSource
from epp.load.token_load import EndpointLoad, TokenLoadTracker
from epp.plugins.token_load import TokenLoadParameters, TokenLoadProducer
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, PluginContext, RequestOutcome
from epp.scheduling.types import SchedulingResult
from tests.epp.extproc_harness import (
    Harness,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    routed_destination,
)
from tests.epp.factories import FakeClock, endpoint_state, make_request, routed_request, tail_rows


def test_lifecycle_moves_tokens_between_accounts() -> None:
    t = TokenLoadTracker()
    t.admit("r", "a", prompt_tokens=1000, cached_tokens=600, expected_output=50)
    assert t.load("a") == EndpointLoad(1, 400, 0, 50, 1000)
    t.first_token("r")
    assert t.load("a") == EndpointLoad(1, 0, 1001, 49, 1001)
    t.progress("r", 60)  # more than expected: the estimate follows
    assert t.load("a") == EndpointLoad(1, 0, 1060, 0, 1060)
    t.finish("r")
    assert t.load("a") == EndpointLoad() and t.in_flight() == 0
    t.finish("r")  # idempotent
    t.admit("s", "b", 10, 50, 5)  # a cache hit larger than the prompt never goes negative
    assert t.load("b").prefill_tokens == 0


def reference(bookings: dict[str, dict]) -> dict[str, EndpointLoad]:
    totals: dict[str, list[int]] = {}
    for b in bookings.values():
        acc = totals.setdefault(b["endpoint"], [0, 0, 0, 0, 0])
        acc[0] += 1
        acc[4] += b["prompt"] + b["generated"]
        if b["decoding"]:
            acc[2] += b["prompt"] + b["generated"]
        else:
            acc[1] += b["uncached"]
        acc[3] += max(0, max(b["expected"], b["generated"]) - b["generated"])
    return {e: EndpointLoad(*v) for e, v in totals.items()}


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "first", "progress", "finish"]),
        st.sampled_from(["r1", "r2", "r3", "r4"]),
        st.sampled_from(["a", "b"]),
        st.integers(0, 500),
        st.integers(0, 500),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_aggregates_match_a_recount_and_drain_to_zero(operations) -> None:
    t = TokenLoadTracker()
    model: dict[str, dict] = {}
    for op, rid, endpoint, x, y in operations:
        if op == "admit":
            t.admit(rid, endpoint, x, y, y)
            model[rid] = {"endpoint": endpoint, "prompt": x, "uncached": max(0, x - min(y, x)),
                          "expected": max(1, y), "generated": 0, "decoding": False}  # fmt: skip
        elif op == "first" and rid in model:
            t.first_token(rid)
            b = model[rid]
            if not b["decoding"]:
                b["decoding"] = True
                b["generated"] = max(b["generated"], 1)
        elif op == "progress" and rid in model:
            t.progress(rid, x)
            b = model[rid]
            if x > b["generated"]:
                b["generated"] = x
                b["expected"] = max(b["expected"], x)
        elif op == "finish":
            t.finish(rid)
            model.pop(rid, None)
        expected = reference(model)
        for e in ("a", "b"):
            assert t.load(e) == expected.get(e, EndpointLoad())
    for rid in list(model):
        t.finish(rid)
    assert t.load("a") == t.load("b") == EndpointLoad() and t.in_flight() == 0


def test_producer_books_on_pick_and_releases_on_finish_however_it_ends() -> None:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1))
    producer = TokenLoadProducer("t", TokenLoadParameters(), context)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    request = make_request(list(range(100)))
    request.max_tokens = 20
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(1, {"e1": 1}, [1], block_size_tokens=64))
    producer.produce(request, endpoints, state)
    assert state.get(TOKEN_LOAD) == {"e0": EndpointLoad(), "e1": EndpointLoad()}
    result = SchedulingResult((endpoints[1].endpoint,), "p")
    producer.pre_request(request, result, state)
    assert producer.tracker.load("e1") == EndpointLoad(1, 36, 0, 20, 100)  # 64 of 100 prompt tokens cached
    producer.on_first_token(routed_request(request, result, state), 0.0)
    producer.on_progress(routed_request(request, result, state), 5, 0.0)
    assert producer.tracker.load("e1") == EndpointLoad(1, 0, 105, 15, 105)
    aborted = RequestOutcome(endpoints[1].endpoint, 0.0, 1.0, 200, True, False, 0.5, 5)
    producer.on_finished(routed_request(request, result, state), aborted)
    assert producer.tracker.load("e1") == EndpointLoad()
    unbounded = make_request(list(range(10)))
    assert producer.expected_output(unbounded) == ExpectedOutput(15, OutputSource.DEFAULT)


def test_a_bookings_row_follows_it_from_prefill_to_decode() -> None:
    t = TokenLoadTracker()
    t.admit("x", "e0", 320, 120, 10)
    t.admit("y", "e0", 100, 0, 10)
    assert t.booking_row("x") == (320, 200, 0, 10, 320)
    t.first_token("x")
    t.progress("x", 4)
    assert t.booking_row("x") == (320, 0, 324, 6, 324)
    rows = [t.booking_row("x"), t.booking_row("y")]
    assert EndpointLoad(2, *(sum(r[i] for r in rows) for i in range(1, 5))) == t.load("e0")  # type: ignore[index]
    t.finish("x")
    assert t.booking_row("x") is None


def continued_producer() -> TokenLoadProducer:
    """A producer whose peers booked, on e0, a 320-token prompt ending in block hash 20 (peer 1),
    two concurrent 160-token prompts both ending in hash 10 (peer 2); on e1 another 320-token
    prompt ending in hash 120."""
    producer = TokenLoadProducer("t", TokenLoadParameters(), PluginContext(clock=FakeClock()))
    producer.peers.replace(1, "e0", (1, 320, 0, 30, 320), tail_rows((20, 320)))
    producer.peers.replace(2, "e0", (2, 320, 0, 60, 320), tail_rows((10, 160), (10, 160)))
    producer.peers.replace(1, "e1", (1, 320, 0, 30, 320), tail_rows((120, 320)))
    producer.tracker.admit(0, "e0", 320, 0, 30)
    return producer


def test_a_prompt_that_extends_a_peers_whole_prompt_releases_that_booking() -> None:
    producer = continued_producer()
    hashes = list(range(1, 26))  # 25 blocks of 16 tokens; e0 holds the first 20 (peer 1's prompt)
    request = make_request(list(range(400)))
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(25, {"e0": 20, "e1": 3}, hashes, block_size_tokens=16))
    producer.produce(request, [endpoint_state(0), endpoint_state(1)], state)
    # The conversation moved on: peer 1's last turn on e0 is over.
    assert producer.peers.load("e0") == EndpointLoad(2, 320, 0, 60, 320)
    assert state.get(TOKEN_LOAD)["e0"] == producer.tracker.load("e0") + producer.peers.load("e0")
    assert state.get(TOKEN_LOAD)["e0"].requests == 3  # our own booking and peer 2's two are kept
    assert producer.peers.load("e1").requests == 1  # e1's match (3 blocks) ends in no booking's tail


def test_a_shared_prefix_or_the_same_prompt_releases_nothing() -> None:
    producer = continued_producer()
    # Extends peer 2's prompt (hash 10 at block 10), but two bookings end there: a prefix shared
    # by concurrent requests (an RL step's prompt), not one conversation's last turn.
    shared = PrefixMatch(15, {"e0": 10}, list(range(1, 16)), block_size_tokens=16)
    assert producer.release_continued_peer_turns(240, shared) == []
    # The same 320-token prompt as peer 1's, sent again: nothing extends it, so it may well run.
    same = PrefixMatch(20, {"e0": 20}, list(range(1, 21)), block_size_tokens=16)
    assert producer.release_continued_peer_turns(320, same) == []
    assert producer.peers.in_flight() == 4


def sse(*texts: str) -> bytes:
    return b"".join(b'data: {"choices":[{"text":"%s"}]}\n\n' % t.encode() for t in texts)


async def routed_stream(h: Harness, body: dict, **headers: str) -> tuple[ExtProcStream, str]:
    """A stream whose request has been routed; returns it and the chosen endpoint's name."""
    s = h.stream()
    await s.on_message(headers_msg(**headers))
    replies = await s.on_message(body_msg(json.dumps(body).encode(), eos=True))
    return s, "e0" if routed_destination(replies[0]).endswith(":8000") else "e1"


def gauges(h: Harness, endpoint: str) -> tuple[float, float]:
    labels = {"name": "pool", "model_server_pod": endpoint}
    return (
        h.registry.get_sample_value("llm_epp_endpoint_prefill_tokens_in_flight", labels),
        h.registry.get_sample_value("llm_epp_endpoint_decode_tokens_in_flight", labels),
    )


STREAMING = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "stream": True}


async def end_completed(s: ExtProcStream) -> None:
    await s.on_message(response_headers_msg())
    await s.on_message(response_body_msg(sse("a", "b") + b"data: [DONE]\n\n", eos=True))


async def end_upstream_5xx(s: ExtProcStream) -> None:
    await s.on_message(response_headers_msg(503, "text/plain"))
    await s.on_message(response_body_msg(b"upstream connect error", eos=True))


async def end_cancelled_mid_stream(s: ExtProcStream) -> None:
    await s.on_message(response_headers_msg())
    await s.on_message(response_body_msg(sse("a"), eos=False))
    s.close()  # Envoy reset the ext_proc stream: the client went away


async def end_cancelled_before_response(s: ExtProcStream) -> None:
    s.close()


async def end_upstream_reset_mid_stream(s: ExtProcStream) -> None:
    await s.on_message(response_headers_msg())
    await s.on_message(response_body_msg(sse("a", "b"), eos=False))
    s.close()  # the replica died: no end of stream, the stream just ends


@pytest.mark.parametrize(
    "ending",
    [
        end_completed,
        end_upstream_5xx,
        end_cancelled_mid_stream,
        end_cancelled_before_response,
        end_upstream_reset_mid_stream,
    ],
)
async def test_every_way_a_stream_ends_releases_its_token_load(ending) -> None:
    h = Harness(config="ray-kv-aware")
    s, target = await routed_stream(h, STREAMING)
    prompt = h.tracker.load(target).prefill_tokens
    assert prompt > 0 and gauges(h, target) == (prompt, 0)
    await ending(s)
    s.close()
    assert h.tracker.load(target) == EndpointLoad() and h.tracker.in_flight() == 0
    assert gauges(h, target) == (0, 0)


async def test_streamed_tokens_move_load_from_prefill_to_decode() -> None:
    h = Harness(config="ray-kv-aware")
    s, target = await routed_stream(h, STREAMING)
    prompt = h.tracker.load(target).prefill_tokens
    await s.on_message(response_headers_msg())
    await s.on_message(response_body_msg(sse("a"), eos=False))
    assert h.tracker.load(target) == EndpointLoad(1, 0, prompt + 1, 3, prompt + 1)
    await s.on_message(response_body_msg(sse("b", "c"), eos=False))
    assert gauges(h, target) == (0, prompt + 3)
    await s.on_message(response_body_msg(sse("d") + b"data: [DONE]\n\n", eos=True))
    assert s.done
    s.close()
    assert h.tracker.in_flight() == 0


async def test_requests_sharing_a_client_request_id_keep_their_own_bookings() -> None:
    # A client retries with the same x-request-id while its first attempt is still being torn
    # down: ending the first attempt must not release the retry's load.
    h = Harness(config="ray-kv-aware")
    first, _ = await routed_stream(h, STREAMING, **{"x-request-id": "same"})
    retry, retry_target = await routed_stream(h, STREAMING, **{"x-request-id": "same"})
    assert h.tracker.in_flight() == 2
    first.close()
    assert h.tracker.in_flight() == 1 and h.tracker.load(retry_target).requests == 1
    await retry.on_message(response_headers_msg())
    await retry.on_message(response_body_msg(sse("a", "b"), eos=False))
    assert h.tracker.load(retry_target).decode_tokens > 0
    retry.close()
    assert h.tracker.in_flight() == 0
