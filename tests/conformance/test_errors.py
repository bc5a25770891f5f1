"""Refused requests: the same status and the same error body (message, type, param, code)."""

from __future__ import annotations

import pytest

from .conftest import Served, on_each

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello world " * 1200  # ~2,400 tokens
CASES = {
    "bad JSON": ("/v1/completions", b'{"model": "tiny", "prompt": '),
    "chat bad JSON": ("/v1/chat/completions", b'{"messages": [}'),
    "prompt over the context": ("/v1/completions", {"model": "tiny", "prompt": LONG_TEXT, "max_tokens": 2}),
    "token ids over the context": ("/v1/completions", {"model": "tiny", "prompt": [5] * 2049}),
    "text over any tokenization": ("/v1/completions", {"model": "tiny", "prompt": "a" * 80_000}),
    "chat over the context": ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": LONG_TEXT}]}),
    "negative max_tokens": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}),
    "no room for output": ("/v1/completions", {"model": "tiny", "prompt": [5] * 2048}),
    "max_tokens over max_model_len": ("/v1/completions", {
        "model": "tiny", "prompt": "hi", "max_tokens": 5000}),
    "max_completion_tokens over max_model_len": ("/v1/chat/completions", {
        "model": "tiny", "messages": HI, "max_completion_tokens": 5000}),
    "max_tokens wrong type": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "many"}),
    "unknown model": ("/v1/completions", {"model": "nope", "prompt": "hi"}),
    "chat unknown model": ("/v1/chat/completions", {"model": "nope", "messages": HI}),
    "missing prompt": ("/v1/completions", {"model": "tiny"}),
    "empty prompt batch": ("/v1/completions", {"model": "tiny", "prompt": []}),
    "empty prompt in a batch": ("/v1/completions", {"model": "tiny", "prompt": [""]}),
    "token id out of vocabulary": ("/v1/completions", {"model": "tiny", "prompt": [2048]}),
    "negative token id": ("/v1/completions", {"model": "tiny", "prompt": [-1, 5]}),
    "stream_options without stream": ("/v1/completions", {
        "model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}),
    "chat missing messages": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 5}),
    "chat empty messages": ("/v1/chat/completions", {"model": "tiny", "messages": []}),
    "tokenize without prompt or messages": ("/tokenize", {"model": "tiny"}),
    "tokenize token ids": ("/tokenize", {"model": "tiny", "prompt": [5, 6]}),
    "tokenize unknown model": ("/tokenize", {"model": "nope", "prompt": "hi"}),
}  # fmt: skip


def send(engine: Served, path: str, payload: object) -> tuple[int, object]:
    if isinstance(payload, bytes):
        response = engine.http.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        response = engine.post(path, payload)
    return response.status_code, response.json()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_error(engines: dict[str, Served], case: str) -> None:
    path, payload = CASES[case]
    answers = on_each(engines, lambda engine: send(engine, path, payload))
    status, body = answers["vllm"]
    assert status in (400, 404) and set(body["error"]) == {"message", "type", "param", "code"}
    assert answers["sim"] == answers["vllm"]


def test_a_missing_model_name_is_accepted(engines: dict[str, Served]) -> None:
    unnamed = {"prompt": "hi", "max_tokens": 2}
    answers = on_each(engines, lambda engine: send(engine, "/v1/completions", unnamed))
    assert {name: (status, body["model"]) for name, (status, body) in answers.items()} == {
        "sim": (200, "tiny"),
        "vllm": (200, "tiny"),
    }
