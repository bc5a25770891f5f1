"""Replay prompts: texts whose token counts and shared prefixes are those the workload asks for."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench.workloads import traces
from bench.workloads.fleet_workloads import WorkloadOptions, build_workload
from bench.workloads.replay_plan import PlannedTurn, PromptTexts, plan_sessions
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR

SLICES = Path(__file__).parents[1] / "fixtures" / "traces"
WINDOW = 32768


@pytest.fixture(autouse=True)
def trace_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traces, "TRACES_DIR", SLICES)


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def texts(tokenizer: ModelTokenizer) -> PromptTexts:
    return PromptTexts(tokenizer)


def rendered(tokenizer: ModelTokenizer, turn: PlannedTurn) -> str:
    return tokenizer.render_chat(turn.chat_messages())


def test_words_are_one_token_each_and_keyed(tokenizer: ModelTokenizer, texts: PromptTexts) -> None:
    text = texts.words(7, 1000)
    assert len(tokenizer.encode(text)) == 1000
    assert texts.words(7, 1000) == text and texts.words(8, 1000) != text
    assert texts.words(7, 10) == tokenizer.decode(tokenizer.encode(text)[:10])  # a prefix of the same key


def test_chat_token_count_matches_the_template(tokenizer: ModelTokenizer, texts: PromptTexts) -> None:
    messages = [texts.words(1, 5), texts.words(2, 30), texts.words(3, 1)]
    roles = ["user", "assistant", "user"]
    chat = [{"role": role, "content": m} for role, m in zip(roles, messages, strict=True)]
    assert texts.chat_tokens([5, 30, 1]) == len(tokenizer.encode(tokenizer.render_chat(chat)))


def test_shared_hash_ids_are_a_shared_token_prefix(tokenizer: ModelTokenizer, texts: PromptTexts) -> None:
    a = tokenizer.encode(texts.blocks([0, 1, 2], 1200, 512))
    b = tokenizer.encode(texts.blocks([0, 1, 9], 1100, 512))
    assert len(a) == 1200 and len(b) == 1100
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 1024 <= shared < 1030  # two blocks of 512 shared; the third differs almost at once


def test_agentic_turns_extend_the_previous_prompt(tokenizer: ModelTokenizer, texts: PromptTexts) -> None:
    workload = build_workload("agentic-weka", WorkloadOptions(limit=3, seed=1, max_model_len=WINDOW))
    sessions = plan_sessions(workload, texts, WINDOW)
    assert plan_sessions(workload, texts, WINDOW) == sessions  # deterministic, so each config gets the same
    extended = as_recorded = checked = 0
    for session, recorded in zip(sessions, workload.sessions, strict=True):
        turns = session.turns[:12]
        for turn, spec in zip(turns, recorded.turns, strict=False):
            assert len(tokenizer.encode(rendered(tokenizer, turn))) == turn.prompt_tokens
            assert turn.prompt_tokens + turn.output_tokens <= WINDOW
            assert turn.output_tokens == spec.output_tokens and turn.think_s == spec.think_s
            as_recorded += turn.prompt_tokens == spec.input_tokens
            checked += 1
        for previous, turn in itertools.pairwise(turns):
            if recorded.turns[turn.index].prefix == "previous":
                assert rendered(tokenizer, turn).startswith(rendered(tokenizer, previous))
                assert turn.prompt_tokens > previous.prompt_tokens
                extended += 1
    assert extended >= 20
    # As long as the workload says, but where a turn adds fewer tokens than the template needs.
    assert as_recorded >= 0.9 * checked


def test_mooncake_requests_share_their_leading_blocks(tokenizer: ModelTokenizer, texts: PromptTexts) -> None:
    workload = build_workload("mooncake-conversation", WorkloadOptions(limit=12, max_model_len=WINDOW))
    sessions = plan_sessions(workload, texts, WINDOW)
    first, second = (s.turns[0] for s in sessions[:2])
    assert [len(s.turns) for s in sessions] == [1] * 12
    assert [s.start_s for s in sessions] == [s.start_s for s in workload.sessions]
    for planned, recorded in zip(sessions, workload.sessions, strict=True):
        assert planned.turns[0].prompt_tokens == recorded.turns[0].input_tokens
    # Every conversation request starts with block 0 (a 512-token system prefix), then differs.
    a, b = (tokenizer.encode(rendered(tokenizer, t)) for t in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 512 <= shared < 520
