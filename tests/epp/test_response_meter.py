from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from epp.requestcontrol.response_meter import ResponseMeter, Usage


def sse(events: list[dict], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


CHAT_STREAM = sse(
    [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    ]
)


def test_counts_tokens_not_role_chunks_and_reads_usage() -> None:
    meter = ResponseMeter(streaming=True)
    assert meter.feed(CHAT_STREAM) == 3
    meter.finish()
    assert meter.done and meter.usage == Usage(8, 3, 4) and meter.completion_tokens == 3


@given(st.lists(st.integers(min_value=1, max_value=len(CHAT_STREAM) - 1), max_size=12))
def test_chunk_boundaries_do_not_matter(cuts: list[int]) -> None:
    meter = ResponseMeter(streaming=True)
    points = [0, *sorted(set(cuts)), len(CHAT_STREAM)]
    total = sum(meter.feed(CHAT_STREAM[a:b]) for a, b in itertools.pairwise(points))
    meter.finish()
    assert total == 3 and meter.usage == Usage(8, 3, 4)


def test_completions_stream_without_usage_counts_events() -> None:
    body = sse([{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [{"text": ""}]}])
    meter = ResponseMeter(streaming=True)
    meter.feed(body.replace(b"\n\n", b"\r\n\r\n"))
    meter.finish()
    assert meter.usage is None and meter.completion_tokens == 2


def test_non_streaming_reads_usage_at_the_end() -> None:
    body = json.dumps(
        {"choices": [{"text": "abc"}], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    ).encode()
    meter = ResponseMeter(streaming=False)
    assert meter.feed(body[:10]) == 0 and meter.feed(body[10:]) == 0
    meter.finish()
    assert meter.usage == Usage(5, 9, None) and meter.completion_tokens == 9


def test_garbage_is_ignored_and_oversized_bodies_are_not_buffered() -> None:
    meter = ResponseMeter(streaming=True)
    assert meter.feed(b"data: {not json}\n\nevent: ping\ndata: [1,2]\n\n") == 0
    big = ResponseMeter(streaming=False, max_buffered_bytes=8)
    big.feed(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}')
    big.finish()
    assert big.usage is None
