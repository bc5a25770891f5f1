"""``--tokenizer-source auto`` through the gateway, as the chart's default runs it: the replicas'
/v1/models name a Hub repository (``--model-root``), the EPP downloads its tokenizer from the
Hub (tests/helm/fake_hub.py stands in for it) or, where it cannot, routes on estimated counts.

The check of exactness: the EPP's own count of each prompt (``inference_objective_input_tokens``)
against the engine's (``usage.prompt_tokens``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from epp.tokenizer.estimated import EstimatedTokenizer
from epp.tokenizer.model import TOKENIZER_FILES
from sim.models import TINY_MODEL_DIR
from sim.processes import free_port
from sim.stack import LocalStack
from tests.helm import fake_hub
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration
REPO = "acme/tiny-chat"
ESTIMATED_LINE = "token counts are estimated from the text"
LABELS = {"model_name": "tiny", "target_model_name": "tiny"}


def _auto_stack(workdir: Path, hub_url: str, **overrides: Any) -> LocalStack:
    return start_stack(
        workdir,
        replicas=2,
        sim_profile="instant",
        sim_args=["--model-root", REPO],
        tokenizer_source="auto",
        epp_env={"HF_ENDPOINT": hub_url, "HF_HOME": str(workdir / "huggingface")},
        **overrides,
    )


def _conversations(count: int = 12) -> list[list[dict[str, str]]]:
    system = {"role": "system", "content": "You answer questions about the fleet's runbooks. " * 6}
    return [
        [system, {"role": "user", "content": f"What does step {i} of runbook {i % 3} do?"}]
        for i in range(count)
    ]


def _send(
    stack: LocalStack, conversations: list[list[dict[str, str]]] | None = None
) -> tuple[list[int], float]:
    """Every conversation through the gateway: the engine's prompt counts, and what the EPP counted."""
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=30)
    before = metric_sum(stack.epp_metrics_url, "inference_objective_input_tokens_sum", **LABELS)
    engine_counts = []
    for messages in conversations or _conversations():
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert reply.usage is not None
        engine_counts.append(reply.usage.prompt_tokens)
    # The access log finishes non-streamed requests (first-token metering), a moment later.
    in_flight = "llm_epp_endpoint_in_flight_requests"
    assert wait_for(lambda: metric_sum(stack.epp_metrics_url, in_flight) == 0, timeout=10)
    after = metric_sum(stack.epp_metrics_url, "inference_objective_input_tokens_sum", **LABELS)
    return engine_counts, after - before


def _gauge(stack: LocalStack) -> float:
    return metric_sum(stack.epp_metrics_url, "llm_epp_tokenizer_estimated")


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    stack = _auto_stack(tmp_path_factory.mktemp("no-hub"), f"http://127.0.0.1:{free_port()}")
    yield stack
    stack.stop()


def test_without_the_hub_requests_are_routed_on_estimated_counts(unreachable: LocalStack) -> None:
    log = unreachable.epp.log_path
    assert wait_for(lambda: ESTIMATED_LINE in log.read_text(), timeout=30), unreachable.epp.log_tail()
    engine_counts, epp_counted = _send(unreachable)  # raises on any failed request
    assert len(engine_counts) == len(_conversations())
    assert _gauge(unreachable) == 1
    estimated = EstimatedTokenizer()
    expected = sum(len(estimated.encode(estimated.render_chat(m))) for m in _conversations())
    assert epp_counted == expected != sum(engine_counts)
    assert log.read_text().count(ESTIMATED_LINE) == 1
    assert REPO in log.read_text()


def test_from_the_hub_the_counts_are_exact(tmp_path: Path) -> None:
    with fake_hub.serve(TINY_MODEL_DIR) as hub:
        stack = _auto_stack(tmp_path, hub.url)
        try:
            assert wait_for(lambda: _gauge(stack) == 0, timeout=30), stack.epp.log_tail()
            engine_counts, epp_counted = _send(stack)
            assert epp_counted == sum(engine_counts)
            assert ESTIMATED_LINE not in stack.epp.log_path.read_text()
        finally:
            stack.stop()
    downloaded = {path.rsplit("/", 1)[1] for path, _ in hub.requests if path.startswith(f"/{REPO}/resolve/")}
    assert set(TOKENIZER_FILES) <= downloaded


def test_sampling_the_hubs_tokenizer_brings_the_estimated_counts_to_the_engines(tmp_path: Path) -> None:
    """``--tokenize-every 2``: after one window of sampled prompts (64) the EPP's estimated counts
    are on the engine's scale, where 4 bytes a token is far off for the tiny model."""
    with fake_hub.serve(TINY_MODEL_DIR) as hub:
        stack = _auto_stack(tmp_path, hub.url, epp_args=["--tokenize-every", "2"])
        try:
            loaded = "tokenizer of acme/tiny-chat loaded"
            assert wait_for(lambda: loaded in stack.epp.log_path.read_text(), timeout=30), (
                stack.epp.log_tail()
            )
            assert _gauge(stack) == 1  # the counts are still estimates
            engine_counts, before = _send(stack, _conversations(130))
            url = stack.epp_metrics_url
            assert metric_sum(url, "llm_epp_tokenizer_sampled_prompts_total") == 65
            assert metric_sum(url, "llm_epp_tokenizer_ratio_changes_total") == 1
            assert abs(before - sum(engine_counts)) / sum(engine_counts) > 0.2  # mostly at 4 bytes
            engine_counts, after = _send(stack, _conversations(12))
            assert abs(after - sum(engine_counts)) / sum(engine_counts) < 0.05
            assert metric_sum(url, "llm_epp_tokenizer_estimate_error") > 0.2  # the window ran at 4 bytes
        finally:
            stack.stop()
