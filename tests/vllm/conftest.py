"""Real vLLM (CPU build, tiny random-weight model) behind real Envoy and the EPP."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from sim.stack import LocalStack
from tests.stacks import start_stack


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    stack = start_stack(tmp_path_factory.mktemp("vllm-stack"), replicas=2, engine="vllm")
    yield stack
    stack.stop()


@pytest.fixture
def vllm_client(vllm_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=60)
