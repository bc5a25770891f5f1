"""One real vLLM 0.32 replica and one simulated replica configured like it, for the session.

Both serve the tiny model as ``tiny`` with 32-token blocks, a 2,048-token context, 512 KV blocks,
prefix caching and KV events on an ``ipc://`` socket. The ``engine`` fixture runs a test against
each; ``engines`` gives a test both, to compare them. ``gateway`` is the gateway (real Envoy and
the EPP) in front of another simulated replica configured alike, to compare with both.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest

from sim.processes import BIN, Component, free_port, http_ok, spawn, wait_until
from sim.real_vllm import BLOCK_SIZE, MAX_MODEL_LEN, VllmReplicaSpec, start_vllm_replicas
from tests.kv_event_subscriber import Subscriber
from tests.stacks import start_stack

NUM_GPU_BLOCKS = 512
VOCAB_SIZE = 2048
ENGINES = ("sim", "vllm")
T = TypeVar("T")


@dataclass
class Served:
    """One running engine under test: its HTTP client and a live KV-events subscription."""

    name: str
    url: str
    kv_events_endpoint: str
    http: httpx.Client
    events: Subscriber

    def post(self, path: str, payload: Any) -> httpx.Response:
        return self.http.post(path, json=payload)

    def complete(self, prompt: str | list[int], max_tokens: int = 1, **fields: Any) -> dict[str, Any]:
        """A non-streamed completion of exactly ``max_tokens`` tokens; its body."""
        payload = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **fields}
        response = self.post("/v1/completions", payload)
        assert response.status_code == 200, response.text
        return response.json()

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache, and drain the KV events still on their way."""
        assert self.post("/reset_prefix_cache", None).json() == {"success": True}
        self.events.pending()


def on_each(engines: dict[str, Served], call: Callable[[Served], T]) -> dict[str, T]:
    """``call`` on each engine, by engine name."""
    return {name: call(engine) for name, engine in engines.items()}


def random_prompt(length: int, seed: int) -> list[int]:
    """``length`` token ids, different for each seed (so no two prompts share a cached block)."""
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB_SIZE) for _ in range(length)]


def sim_argv(port: int, kv_events_endpoint: str) -> list[str]:
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_endpoint}
    return [
        str(BIN / "llm-epp-sim"), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "tiny", "--profile", "instant", *sim_sizes(),
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


def sim_sizes() -> list[str]:
    return [
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
    ]  # fmt: skip


def subscribe(http: httpx.Client, endpoint: str) -> Subscriber:
    """A subscription known to be live: completions of fresh one-block prompts until a batch
    (its BlockStored) arrives."""
    subscriber = Subscriber(endpoint)
    subscriber.prime(
        lambda attempt: http.post(
            "/v1/completions",
            json={"prompt": random_prompt(BLOCK_SIZE + 1, -1 - attempt), "max_tokens": 1},
        ).raise_for_status()
    )
    return subscriber


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    workdir = tmp_path_factory.mktemp("conformance")
    sim_port, vllm_port = free_port(), free_port()
    sim_endpoint = f"ipc://{workdir}/kv-sim.sock"
    components: list[Component] = []
    served: list[Served] = []
    spec = VllmReplicaSpec(port=vllm_port, workdir=workdir)
    try:
        # The simulator starts while vLLM boots (~20 s).
        components.append(spawn("sim", sim_argv(sim_port, sim_endpoint), workdir))
        components += start_vllm_replicas([spec], ["vllm"])
        wait_until(components[0], http_ok(f"http://127.0.0.1:{sim_port}/health"))
        for name, port, endpoint in (
            ("sim", sim_port, sim_endpoint),
            ("vllm", vllm_port, spec.kv_events_endpoint),
        ):
            url = f"http://127.0.0.1:{port}"
            http = httpx.Client(base_url=url, timeout=60)
            served.append(Served(name, url, endpoint, http, subscribe(http, endpoint)))
        yield {engine.name: engine for engine in served}
    finally:
        for engine in served:
            engine.events.close()
            engine.http.close()
        for component in components:
            component.stop()
        shutil.rmtree(spec.tmpdir, ignore_errors=True)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, engines: dict[str, Served]) -> Served:
    return engines[request.param]


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    workdir = tmp_path_factory.mktemp("gateway")
    stack = start_stack(workdir, replicas=1, sim_profile="instant", sim_args=sim_sizes())
    try:
        with httpx.Client(base_url=stack.gateway_url, timeout=60) as http:
            yield http
    finally:
        stack.stop()
