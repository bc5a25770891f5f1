"""Support shared by every test tier: polling for evidence, reading Prometheus metrics, and serving
an app on a loopback port.

Polling bounds are bounds, not measurements: a test waits for the evidence that a step ran and
fails when it never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from sim.server import ReplicaServer

PROSE_WORDS = [
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "a",
    "replica",
    "whose",
    "cache",
    "holds",
    "its",
    "prefix",
]


def prose(rng: random.Random, words: int) -> str:
    """``words`` words drawn from :data:`PROSE_WORDS`, ended by a full stop."""
    return " ".join(rng.choice(PROSE_WORDS) for _ in range(words)) + "."


async def eventually(
    condition: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition", interval_s: float = 0.01
) -> None:
    """Poll ``condition()`` on the running loop until it holds; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval_s)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate()`` from a thread that may block; whether it held within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, as ``prometheus_client.parser`` reads it."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape(url: str) -> list[Sample]:
    """Every sample a ``/metrics`` endpoint exports now."""
    return parse_samples(httpx.get(url, timeout=5).text)


def matching(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    """The samples of ``name`` whose labels include ``labels`` (each label compared whole)."""
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` with exactly ``labels``, or None if there is none."""
    for sample in parse_samples(text):
        if sample.name == name and sample.labels == labels:
            return sample.value
    return None


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` at ``url`` whose labels include ``labels``."""
    return sum(s.value for s in matching(scrape(url), name, **labels))


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """``app`` (lifespan included) on a real loopback socket, in this event loop; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = ReplicaServer(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
