"""Real vLLM (CPU build, tiny random-weight model) behind real Envoy and the EPP, with the
predicted-latency pipeline (trainer and one predictor)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # With the trainer and a predictor, so the same replicas also test learning from real traffic.
    stack = start_stack(
        tmp_path_factory.mktemp("vllm-stack"), replicas=2, engine="vllm", predictors=1,
        trainer_args=["--retrain-interval-s", "1", "--min-samples", "40"],
    )  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture
def vllm_client(vllm_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=60)
