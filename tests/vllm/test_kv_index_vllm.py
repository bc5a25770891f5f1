"""The EPP's precise index, fed by real vLLM's KV events: it names the blocks vLLM caches with the
EPP's own hashing of the prompt, predicts vLLM's ``cached_tokens``, and follows evictions.

The EPP's KV-events subscriber runs in the test, subscribed to replica 0 of the session's
real-vLLM stack (512 blocks of 32 tokens; the ipc publisher takes any number of subscribers).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.kv_events import KVEventsSubscriber
from epp.datalayer.metrics import KVEventMetrics
from epp.kvcache.block_hash import BlockHasher
from epp.kvcache.precise_index import PreciseIndex
from epp.scheduling.types import Endpoint
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from sim.real_vllm import BLOCK_SIZE, vllm_python
from sim.stack import LocalStack
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
NAME = "replica-0"
HASHER = BlockHasher()
# 511 usable blocks; a 1,900-token prompt and its output token take 60.
FILL_PROMPT_TOKENS = 1900
MAX_FILL_PROMPTS = 12


@dataclass
class Follower:
    http: httpx.AsyncClient
    index: PreciseIndex
    registry: CollectorRegistry

    def matched(self, tokens: list[int], cache_salt: str | None = None) -> int:
        chain = HASHER.external_chain(tokens, BLOCK_SIZE, cache_salt=cache_salt)
        return self.index.longest_prefix(chain).get(NAME, 0)

    async def complete(self, prompt: str | list[int], cache_salt: str | None = None) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = await self.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    async def settled(self, quiet_s: float = 0.5) -> None:
        """Wait until no event has come for ``quiet_s`` (vLLM publishes from its own thread)."""
        last = -1.0
        while (count := self.events_received()) != last:
            last = count
            await asyncio.sleep(quiet_s)

    def events_received(self) -> float:
        return sum(
            self.registry.get_sample_value(
                "llm_epp_kv_events_received_total", {"model_server_pod": NAME, "type": kind}
            )
            or 0.0
            for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        )


def random_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


@pytest.fixture
async def follower(vllm_stack: LocalStack) -> AsyncIterator[Follower]:
    store, index, registry = EndpointStore(), PreciseIndex(), CollectorRegistry()
    clock = asyncio.get_running_loop().time
    subscriber = KVEventsSubscriber(store, index, clock, KVEventMetrics(registry))
    spec = vllm_stack.vllm_spec(0)
    store.replace([Endpoint(NAME, "127.0.0.1", spec.port, kv_events_endpoint=spec.kv_events_endpoint)])
    subscriber.start()
    http = httpx.AsyncClient(base_url=vllm_stack.replica_url(0), timeout=120)
    follower = Follower(http, index, registry)
    try:
        # ZMQ drops what a PUB sends before a subscription is live: prime with fresh prompts.
        for attempt in range(50):
            primer = random_tokens(BLOCK_SIZE + 1, -1 - attempt)
            await follower.complete(primer)
            await asyncio.sleep(0.2)
            if follower.matched(primer) == 1:
                break
        else:
            raise AssertionError("the subscription to vLLM's KV events never went live")
        yield follower
    finally:
        await http.aclose()
        await subscriber.close()


async def test_index_names_vllms_blocks_by_the_epps_hashes_and_follows_evictions(follower: Follower) -> None:
    # A first line no other test sends: vLLM publishes BlockStored only for blocks it newly caches,
    # and the gateway tests may have left a prompt like this one cached before we subscribed.
    prompt = "# the KV-index test's own prompt\n" + (
        "def handler(event, context):\n    return {'status': 200, 'body': event['body']}\n" * 16 + "# end"
    )
    tokens = ModelTokenizer(TINY_MODEL_DIR).encode(prompt)
    blocks = len(tokens) // BLOCK_SIZE
    assert blocks >= 8 and len(tokens) % BLOCK_SIZE
    usage = await follower.complete(prompt)
    assert usage["prompt_tokens"] == len(tokens)
    await eventually(lambda: follower.matched(tokens) == blocks, timeout_s=60)
    # The index predicts what vLLM reports as cached.
    assert (await follower.complete(prompt))["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK_SIZE

    # Fill the cache past its 511 blocks with other prompts: vLLM evicts the least recent first.
    for seed in range(MAX_FILL_PROMPTS):
        await follower.complete(random_tokens(FILL_PROMPT_TOKENS, 7000 + seed))
        await follower.settled(0.3)
        if follower.matched(tokens) < blocks:
            break
    else:
        raise AssertionError(f"the prompt's blocks were still indexed after {MAX_FILL_PROMPTS} fills")
    removed = follower.registry.get_sample_value(
        "llm_epp_kv_events_received_total", {"model_server_pod": NAME, "type": "BlockRemoved"}
    )
    assert removed and removed > 0
    assert follower.index.blocks_held(NAME) <= 512
    await follower.settled()
    predicted = follower.matched(tokens) * BLOCK_SIZE
    assert (await follower.complete(prompt))["prompt_tokens_details"]["cached_tokens"] == predicted


async def test_a_cache_salt_keeps_tenants_apart_in_vllm_and_in_the_index(follower: Follower) -> None:
    tokens, blocks = random_tokens(6 * BLOCK_SIZE + 3, seed=2727), 6
    await follower.complete(tokens, cache_salt="tenant-a")
    await eventually(lambda: follower.matched(tokens, "tenant-a") == blocks, timeout_s=60)
    # Under another salt, or none, neither the index nor vLLM finds a block of it.
    for other in ("tenant-b", None):
        assert follower.matched(tokens, other) == 0
        usage = await follower.complete(tokens, cache_salt=other)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # Each copy is cached, and indexed, under its own salt; the first tenant still hits its own.
    await eventually(
        lambda: follower.matched(tokens, "tenant-b") == blocks and follower.matched(tokens) == blocks,
        timeout_s=60,
    )
    usage = await follower.complete(tokens, cache_salt="tenant-a")
    assert usage["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK_SIZE


def test_a_custom_seed_hashes_as_vllm_does() -> None:
    """vLLM's own block hash with ``PYTHONHASHSEED`` set, against ``hashSeed``."""
    tokens = random_tokens(3 * BLOCK_SIZE, 1)
    script = (
        "import json, sys\n"
        "from vllm.utils.hashing import sha256\n"
        "from vllm.v1.core import kv_cache_utils as k\n"
        "k.init_none_hash(sha256)\n"
        "tokens, parent, out = json.loads(sys.argv[1]), None, []\n"
        f"for i in range(0, len(tokens), {BLOCK_SIZE}):\n"
        f"    parent = k.hash_block_tokens(sha256, parent, tokens[i : i + {BLOCK_SIZE}], None)\n"
        "    out.append(parent.hex())\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "1234", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [str(vllm_python()), "-c", script, json.dumps(tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    vllms = json.loads(result.stdout.strip().splitlines()[-1])
    ours = [d.hex() for d in BlockHasher("sha256", "1234").chain(tokens, BLOCK_SIZE)]
    assert ours == vllms
    assert ours != [d.hex() for d in HASHER.chain(tokens, BLOCK_SIZE)]
