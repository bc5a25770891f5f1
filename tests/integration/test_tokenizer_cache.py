"""The EPP's tokenizer cache through the gateway. The test stacks run the EPP with
``--verify-tokenizer-cache``: every reused tokenization is also checked against a full one, and
the stack fails at teardown if any differed (``tests.stacks.CheckedStack``)."""

from __future__ import annotations

import openai
import pytest

from sim.stack import LocalStack
from tests.support import metric_sum

pytestmark = pytest.mark.integration
COUNTS = ("hits", "misses", "fallbacks", "cut_failures", "tokens_reused", "verified", "mismatches")


def cache_counts(stack: LocalStack) -> dict[str, float]:
    return {
        name: metric_sum(stack.epp_metrics_url, f"llm_epp_tokenizer_cache_{name}_total") for name in COUNTS
    }


def test_a_growing_conversation_is_tokenized_incrementally(stack: LocalStack, client: openai.OpenAI) -> None:
    before = cache_counts(stack)
    messages = [{"role": "system", "content": "You review pull requests, tersely and kindly. " * 8}]
    prompt_tokens = []
    for turn in range(8):
        question = f"Turn {turn}: look at file_{turn}.py near line {turn * 7}; is the loop's bound right?"
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
        prompt_tokens.append(reply.usage.prompt_tokens)
        # The simulated model's reply (arbitrary decoded tokens) goes into the next turn's prompt.
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    after = cache_counts(stack)
    delta = {name: after[name] - before[name] for name in COUNTS}
    assert prompt_tokens == sorted(prompt_tokens)
    assert delta["hits"] >= 7 and delta["verified"] >= delta["hits"]
    assert delta["tokens_reused"] > sum(prompt_tokens[:-1]) * 0.8  # nearly all of each earlier turn
    assert after["mismatches"] == 0 and after["cut_failures"] == 0


def test_completion_prompts_that_extend_each_other_reuse_tokens(
    stack: LocalStack, client: openai.OpenAI
) -> None:
    before = cache_counts(stack)
    prompt = "Summarise the incident report below.\n\n"
    for part in range(6):
        prompt += f"At 0{part}:15 the on-call engineer saw queue depth {part * 113} on shard {part}; "
        prompt += "they drained it and filed a follow-up.\n" * 5
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    after = cache_counts(stack)
    assert after["hits"] - before["hits"] >= 5 and after["mismatches"] == 0
