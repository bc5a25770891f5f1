"""A test-side KV-events client: a SUB socket that decodes and checks vLLM's wire format, and a
replay request. Shared by the simulator's tests and the conformance suite (simulator and vLLM)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

END_SEQ = -1


@dataclass(frozen=True, slots=True)
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int

    def of_type(self, event_type: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["type"] == event_type]


def decode(frames: list[bytes]) -> Batch:
    """One PUB message ``[topic, seq, msgpack([ts, events, dp_rank])]``; asserts its framing."""
    assert len(frames) == 3, f"expected 3 frames, got {len(frames)}"
    topic, seq, payload = frames
    assert len(seq) == 8, f"seq frame of {len(seq)} bytes"
    decoded = msgpack.unpackb(payload, strict_map_key=False)
    assert isinstance(decoded, list) and len(decoded) == 3, decoded
    ts, events, rank = decoded
    assert isinstance(ts, float) and isinstance(events, list) and isinstance(rank, int), decoded
    assert all(isinstance(event, dict) and next(iter(event)) == "type" for event in events), events
    return Batch(topic, int.from_bytes(seq, "big"), ts, events, rank)


class Subscriber:
    """A SUB socket on ``endpoint`` (connecting, or binding when the publisher connects)."""

    def __init__(self, endpoint: str, *, bind: bool = False, topic: bytes = b"") -> None:
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        if bind:
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)

    def receive_frames(self, timeout_s: float = 10.0) -> list[bytes]:
        """The next message as sent; fails if none comes within ``timeout_s`` (a bound, not a
        measurement)."""
        assert self._socket.poll(int(timeout_s * 1000)), f"no KV events batch within {timeout_s} s"
        return self._socket.recv_multipart()

    def receive(self, timeout_s: float = 10.0) -> Batch:
        return decode(self.receive_frames(timeout_s))

    def pending(self, quiet_s: float = 0.2) -> list[Batch]:
        """Every batch that arrives until none has come for ``quiet_s``."""
        batches = []
        while self._socket.poll(int(quiet_s * 1000)):
            batches.append(decode(self._socket.recv_multipart()))
        return batches

    def until(self, done: Callable[[Batch], bool], timeout_s: float = 10.0) -> list[Batch]:
        """Batches up to and including the first for which ``done`` holds."""
        batches = []
        while True:
            batches.append(self.receive(timeout_s))
            if done(batches[-1]):
                return batches

    def prime(self, trigger: Callable[[int], None], attempts: int = 50) -> None:
        """Wait until the subscription is live (ZMQ drops what a PUB sends before it is):
        ``trigger(i)`` makes the publisher send a batch; repeat until one arrives, then drain."""
        for attempt in itertools.count():
            assert attempt < attempts, "the subscription never received a batch"
            trigger(attempt)
            if self._socket.poll(200):
                break
        self.pending()

    def close(self) -> None:
        self._socket.close(linger=0)


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """Ask a replay socket for the batches from ``start_seq`` on; the messages up to and
    including the end marker, each without the DEALER's empty delimiter frame."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        messages = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "replay answer did not end"
            empty, *frames = dealer.recv_multipart()
            assert empty == b"" and len(frames) == 3, frames
            messages.append(frames)
            if int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                return messages
    finally:
        dealer.close(linger=0)
