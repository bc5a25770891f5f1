"""Token counts estimated from the text: a count per 4 bytes, ids that keep shared prefixes
shared, and a director that routes on them without refusing prompts for their estimated length."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.errors import BadRequest
from epp.kvcache.block_hash import chain_hashes
from epp.tokenizer.estimated import BYTES_PER_TOKEN, EstimatedTokenizer
from epp.tokenizer.model import ChatTemplateError, ModelTokenizer
from sim.models import TINY_MODEL_DIR
from tests.epp.extproc_harness import Harness

ESTIMATED = EstimatedTokenizer()


@given(text=st.text())
def test_one_token_per_four_bytes_begun(text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    assert len(ESTIMATED.encode(text)) == math.ceil(size / BYTES_PER_TOKEN)


@given(prefix=st.text(min_size=1), a=st.text(), b=st.text())
def test_texts_that_share_a_prefix_share_its_ids_and_blocks(prefix: str, a: str, b: str) -> None:
    shared = len(prefix.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
    ids_a, ids_b = ESTIMATED.encode(prefix + a), ESTIMATED.encode(prefix + b)
    assert ids_a[:shared] == ids_b[:shared]
    block = 4
    assert chain_hashes(ids_a, block)[: shared // block] == chain_hashes(ids_b, block)[: shared // block]


def test_different_text_gets_different_ids() -> None:
    assert ESTIMATED.encode("the cat sat") != ESTIMATED.encode("the dog sat")


def test_a_conversation_that_grows_keeps_its_rendered_prefix() -> None:
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    longer = [*turn, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More"}]
    first = ESTIMATED.render_chat(turn, add_generation_prompt=False)
    assert ESTIMATED.render_chat(longer).startswith(first)
    assert "Be brief." in first and "Hi" in first


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], [{"role": "user", "content": 5}]])
def test_chat_messages_are_checked_as_with_a_model_template(messages: list[dict[str, object]]) -> None:
    with pytest.raises(ChatTemplateError):
        ESTIMATED.render_chat(messages)
    with pytest.raises(ChatTemplateError):
        ModelTokenizer(TINY_MODEL_DIR).render_chat(messages)


LONG = {"model": "tiny", "prompt": "many words here " * 20, "max_tokens": 4}


async def _schedule(harness: Harness, body: dict[str, object]) -> list[int]:
    record = harness.director.open({})
    async for _ in record.schedule("/v1/completions", {}, json.dumps(body).encode()):
        pass
    assert record.request is not None
    return record.request.prompt_token_ids


async def test_estimated_counts_route_without_refusing_for_length() -> None:
    exact = Harness(default_max_model_len=8)
    with pytest.raises(BadRequest):
        await _schedule(exact, LONG)
    estimated = Harness(tokenizer=EstimatedTokenizer(), default_max_model_len=8)
    ids = await _schedule(estimated, LONG)
    assert ids == ESTIMATED.encode(LONG["prompt"])  # type: ignore[arg-type]


async def test_a_replaced_tokenizer_counts_the_next_request() -> None:
    harness = Harness(tokenizer=EstimatedTokenizer())
    before = await _schedule(harness, LONG)
    harness.director.tokenizer = ModelTokenizer(TINY_MODEL_DIR)
    after = await _schedule(harness, LONG)
    assert before == ESTIMATED.encode(LONG["prompt"])  # type: ignore[arg-type]
    assert after == ModelTokenizer(TINY_MODEL_DIR).encode(LONG["prompt"])  # type: ignore[arg-type]
