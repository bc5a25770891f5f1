"""KV-cache events over ZMQ, on the wire exactly as vLLM 0.32's ``ZmqEventPublisher`` sends them.

Each batch (the events of one engine step) is a three-frame PUB message::

    [topic, seq (8-byte big-endian, 0, 1, 2, ... per publisher), msgpack([ts, [event, ...], 0])]

where ``ts`` is wall-clock seconds, the trailing 0 is the data-parallel rank and each event is a map
whose first key is ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), as msgspec
encodes vLLM's tagged structs (the engine builds the maps, ``sim.engine.kv_cache``).

Replay: when ``replay_endpoint`` is set, a ROUTER socket answers a request ``[b"", start_seq
(8-byte big-endian)]`` (as a DEALER or REQ client sends it) with one ``[b"", topic, seq, payload]``
message per buffered batch whose seq is at least ``start_seq`` (the last ``buffer_steps``
batches), then the end marker ``[b"", b"", seq -1 (8-byte signed big-endian), b""]``.

Who binds: an endpoint containing ``*`` or ``::``, or an ``ipc://`` or ``inproc://`` one, is bound by
the publisher; any other (an explicit host) is connected to, so the subscriber binds. The replay
socket always binds.

Unlike vLLM, which hands batches to a publisher thread through a queue of ``max_queue_size``,
the simulator publishes on its event loop: a PUB send never blocks (past ``hwm`` queued messages
per subscriber, ZMQ drops them), so there is no queue and ``max_queue_size`` is accepted and
ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DATA_PARALLEL_RANK = 0
# Replay answers are sent in slices, so a long replay lets the engine loops run in between.
REPLAY_SLICE = 256


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` (``vllm.config.KVEventsConfig``): same keys, defaults and
    strictness (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """Defaults to "zmq" when events are enabled, else "null"."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        return self

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _offsettable(cls, endpoint: str | None) -> str | None:
        # Checked up front, so deriving a replica's endpoints (for_replica) cannot fail later.
        offset_endpoint(endpoint, 1)
        return endpoint

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_replica(self, index: int) -> KVEventsConfig:
        """The config of replica ``index`` of a multi-replica server: both endpoints offset as vLLM
        offsets a data-parallel rank's (``offset_endpoint``)."""
        return self.model_copy(
            update={
                "endpoint": offset_endpoint(self.endpoint, index),
                "replay_endpoint": offset_endpoint(self.replay_endpoint, index),
            }
        )


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    """Endpoint of replica ``index``: index 0 keeps it; otherwise a tcp port grows by ``index`` (port 0
    stays 0, for the OS to pick) and an ipc or inproc address gets ``_dp{index}`` appended.

    vLLM applies the same rule to data-parallel ranks, except that it has none for ipc.
    """
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"
    raise ValueError(
        f"invalid KV events endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc:// or inproc://"
    )


def publisher_binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects and the subscriber binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_batch(ts: float, events: Sequence[dict[str, Any]]) -> bytes:
    """The payload frame: msgpack of ``[ts, events, data_parallel_rank]``."""
    return msgpack.packb([ts, list(events), DATA_PARALLEL_RANK])


class KVEventPublisher:
    """Publishes one engine's KV-event batches and answers replay requests.

    Sockets are bound (or connected) by the constructor, so a bad or busy endpoint fails at
    start-up with ``zmq.ZMQError``. ``publish`` is synchronous and never blocks; the replay socket
    is served by ``serve_replay``, a coroutine to run as a task in the server's event loop.
    ``config`` reports the endpoints actually bound (``tcp://*:0`` resolved to its port).
    """

    def __init__(self, config: KVEventsConfig) -> None:
        if not config.publishes:
            raise ValueError("KV events are not enabled with the zmq publisher")
        context = zmq.Context.instance()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        self._replay_async: zmq.asyncio.Socket | None = None
        try:
            if publisher_binds(config.endpoint):
                endpoint = _bind(self._pub, config.endpoint)
            else:
                self._pub.connect(config.endpoint)
                endpoint = config.endpoint
            replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                replay_endpoint = _bind(self._replay, config.replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.config = config.model_copy(update={"endpoint": endpoint, "replay_endpoint": replay_endpoint})

    def publish(self, events: Sequence[dict[str, Any]]) -> None:
        """Send one batch stamped with the wall clock; an empty ``events`` sends nothing."""
        if not events:
            return
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # As in vLLM: a lost batch is a seq gap for subscribers (replay covers it), never a
            # reason to stop the engine.
            logger.warning("KV events batch %d not sent: %s", seq, exc)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled; returns at once without a replay endpoint."""
        if self._replay is None:
            return
        replay = self._replay_async = zmq.asyncio.Socket.from_socket(self._replay)
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("ignoring a malformed KV events replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            for index, (seq, payload) in enumerate(batches, start=1):
                # A ROUTER send never blocks: past the client's hwm ZMQ drops, as vLLM's does.
                await replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                if index % REPLAY_SLICE == 0:
                    await asyncio.sleep(0)
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Close the sockets; cancel the ``serve_replay`` task first."""
        self._pub.close(linger=0)
        # The asyncio wrapper shares the socket; closing through it also unhooks it from the loop.
        replay = self._replay_async or self._replay
        if replay is not None:
            replay.close(linger=0)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the bound endpoint (a ``tcp`` port 0 resolved to the port the OS chose)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint
