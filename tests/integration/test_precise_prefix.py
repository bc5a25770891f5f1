"""Precise prefix-cache routing end to end: simulated replicas publish KV events, the EPP (config
``precise-prefix``) subscribes, hashes prompts as the engines do, and routes to the cache.

A prompt is cached on a replica by sending it there directly, past the gateway, so the EPP's
routing history knows nothing of it: only the replica's KV events can send the prompt back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import openai
import pytest

from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from sim.stack import LocalStack
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("precise"),
        replicas=3,
        sim_profile="instant",
        sim_args=["--block-size", str(BLOCK_SIZE)],
        epp_config="precise-prefix",
        kv_events=True,
    )
    yield s
    s.stop()


def index_blocks(stack: LocalStack, replica: int) -> float:
    return metric_sum(stack.epp_metrics_url, "llm_epp_kv_index_blocks", model_server_pod=f"replica-{replica}")


@pytest.mark.parametrize(("holder", "topic"), [(2, "shipping"), (0, "weather")])
def test_a_prompt_cached_behind_the_gateways_back_is_routed_to_its_replica(
    stack: LocalStack, holder: int, topic: str
) -> None:
    prompt = f"You answer questions about {topic} for a large company, politely and briefly. " * 30
    tokens = ModelTokenizer(TINY_MODEL_DIR).encode(prompt)
    blocks = len(tokens) // BLOCK_SIZE
    assert blocks >= 10
    before = index_blocks(stack, holder)
    direct = httpx.post(
        f"{stack.replica_url(holder)}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        timeout=30,
    )
    assert direct.json()["usage"]["prompt_tokens"] == len(tokens)  # the EPP tokenizes like the engine
    # The EPP's index follows the replica's BlockStored events.
    assert wait_for(lambda: index_blocks(stack, holder) >= before + blocks), index_blocks(stack, holder)

    routed = httpx.post(
        f"{stack.gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt + " And one more thing?", "max_tokens": 2},
        headers={"x-llm-epp-debug": "true"},
        timeout=30,
    )
    assert routed.status_code == 200, routed.text
    # The EPP's hashes of the prompt are the engine's: it went where they are cached.
    assert routed.headers["x-llm-epp-endpoint"] == f"replica-{holder}"
    assert (
        routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= blocks * BLOCK_SIZE - BLOCK_SIZE
    )
    stale = metric_sum(stack.epp_metrics_url, "llm_epp_kv_events_stale")
    assert stale == 0  # every replica's events are live
    assert metric_sum(stack.epp_metrics_url, "llm_epp_kv_events_gaps_total", outcome="rebuilt") == 0


def test_a_multi_turn_conversation_keeps_hitting_its_cache(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "You track parcels for a harbour logistics firm. " * 20}]
    cached, endpoints = [], set()
    for turn in range(5):
        # Each turn adds well over a block (32 tokens), so the cached prefix grows every turn.
        question = f"Turn {turn}: where is parcel {turn * 7919}, and when does it leave the dock? " * 4
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=8, extra_headers={"x-llm-epp-debug": "true"}
        )
        reply = raw.parse()
        endpoints.add(raw.headers["x-llm-epp-endpoint"])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert len(endpoints) == 1, endpoints  # every turn went back to the replica holding the conversation
    assert cached[0] == 0 and all(later > earlier for earlier, later in itertools.pairwise(cached)), cached
