"""The gateway in front of real vLLM replicas: the same promises as with simulated ones."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack
from tests.support import matching, metric_sum, scrape, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
LONG_PROMPT = "def handler(event, context):\n    return {'status': 200, 'body': event['body']}\n" * 20


def test_completions_and_chat_streamed_and_not(vllm_client: openai.OpenAI) -> None:
    completion = vllm_client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 5 and completion.usage.prompt_tokens == 5
    stream = vllm_client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for c in stream if c.choices and c.choices[0].text) >= 1
    chat = vllm_client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3
    chunks = list(
        vllm_client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 3


def test_epp_scrapes_real_vllm_metrics(vllm_stack: LocalStack) -> None:
    samples = scrape(vllm_stack.epp_metrics_url)
    assert metric_sum(vllm_stack.epp_metrics_url, "inference_pool_ready_pods") == 2
    ages = [s.value for s in matching(samples, "llm_epp_endpoint_metrics_age_seconds")]
    assert len(ages) == 2 and max(ages) < 2.0  # fresh scrapes of both replicas


def test_long_prompt_twice_lands_on_the_replica_that_cached_it(vllm_client: openai.OpenAI) -> None:
    first = vllm_client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens > 256
    second = vllm_client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens - 1) // 32 * 32 - 32, cached


def test_killed_vllm_replica_mid_stream(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, engine="vllm")
    try:
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="Hi", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        running = [metric_sum(stack.replica_url(i) + "/metrics", "vllm:num_requests_running") for i in (0, 1)]
        victim = running.index(1.0)
        stack.replicas[victim].stop(signal.SIGKILL)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in chunks:
                pass
        pod = f"replica-{victim}"
        assert wait_for(
            lambda: metric_sum(stack.epp_metrics_url, "llm_epp_endpoint_healthy", model_server_pod=pod) == 0
        )
        for _ in range(5):
            r = client.completions.create(
                model="tiny", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}
            )
            assert r.usage.completion_tokens == 2
        assert stack.epp.alive()
    finally:
        stack.stop()


def test_trainer_learns_from_real_vllm_traffic(vllm_stack: LocalStack, vllm_client: openai.OpenAI) -> None:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    version = lambda: metric_sum(f"{vllm_stack.trainer_url}/metrics", "trainer_model_version")  # noqa: E731
    requests = iter(range(400))

    def one_more_request_then_published() -> bool:
        # The trainer withholds a model that does not beat predicting the median on its held-out
        # samples, and refits as samples arrive, so traffic goes on until a model is published.
        i = next(requests)
        text = " ".join(words[(i + k) % len(words)] for k in range(10 + (i * 37) % 400))
        # Streamed: in streaming mode the EPP measures TTFT and TPOT from the token stream.
        stream = vllm_client.completions.create(
            model="tiny", prompt=f"{i}: {text}", max_tokens=4 + i % 6, stream=True
        )
        assert list(stream)
        return i >= 60 and version() >= 1

    assert wait_for(one_more_request_then_published, timeout=120), (
        "the trainer never published a model fitted on vLLM's latencies"
    )
    samples = metric_sum(f"{vllm_stack.trainer_url}/metrics", "trainer_model_training_samples", model="ttft")
    assert samples >= 30  # of the >= 40 the trainer waited for, the rest are held out to evaluate
    # The EPP's predictor picks the model up, and predictions reach routing decisions.
    seen: dict[str, str] = {}

    def predicted() -> bool:
        raw = vllm_client.completions.with_raw_response.create(
            model="tiny", prompt="a short probe", max_tokens=2, extra_headers={"x-llm-epp-debug": "true"}
        )
        seen.update(raw.headers)
        return "x-llm-epp-predicted-ttft-ms" in raw.headers

    assert wait_for(predicted, timeout=30)
    assert float(seen["x-llm-epp-predicted-ttft-ms"]) > 0
