"""The OpenAI API: response layouts, SSE framing, usage and prefix-cache accounting, /tokenize."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.openai_wire import shape, sse_payloads

from .conftest import Served, on_each, random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MESSAGES = [{"role": "user", "content": "Write a haiku about caches, then explain it."}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# The request of each route, and the object names of its whole response and of its stream chunks.
REQUESTS = {
    COMPLETIONS: ({"prompt": "def main():"}, "text_completion", "text_completion"),
    CHAT: ({"messages": MESSAGES}, "chat.completion", "chat.completion.chunk"),
}


def generation(path: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    payload, _, _ = REQUESTS[path]
    return {"model": "tiny", **payload, "max_tokens": max_tokens, "ignore_eos": True, **fields}


def layouts(shapes: list[Any]) -> list[Any]:
    """Shapes with runs of equal ones collapsed: how many content chunks vLLM sends for N tokens
    depends on its detokenizer (it holds back partial characters), not on the layout."""
    return [item for index, item in enumerate(shapes) if index == 0 or shapes[index - 1] != item]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_whole_responses_have_the_same_layout(engines: dict[str, Served], path: str) -> None:
    _, object_name, _ = REQUESTS[path]
    bodies = on_each(engines, lambda engine: engine.post(path, generation(path, 4)).json())
    assert shape(bodies["sim"]) == shape(bodies["vllm"])
    for body in bodies.values():
        assert (body["object"], body["model"], len(body["choices"])) == (object_name, "tiny", 1)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
    assert bodies["sim"]["usage"] == bodies["vllm"]["usage"]


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_streams_have_the_same_framing_and_layout(
    engines: dict[str, Served], path: str, include_usage: bool
) -> None:
    _, _, chunk_object = REQUESTS[path]
    payload = generation(path, 4, stream=True, stream_options={"include_usage": include_usage})
    shapes = {}
    for name, engine in engines.items():
        response = engine.post(path, payload)
        assert response.headers["content-type"].startswith("text/event-stream")
        # Each event is one "data: " line followed by a blank line; the last is [DONE].
        events = response.text.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]", name
        assert all(event.startswith("data: ") and "\n" not in event for event in events[:-1]), name
        chunks = sse_payloads(response.text)[:-1]
        assert {chunk["object"] for chunk in chunks} == {chunk_object}, name
        if include_usage:
            *chunks, usage_chunk = chunks
            assert usage_chunk["choices"] == [], name
            assert usage_chunk["usage"]["completion_tokens"] == 4, name
        assert not any("usage" in chunk for chunk in chunks), name
        if path == CHAT:
            role, *chunks = chunks
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}, name
            assert role["choices"][0]["finish_reason"] is None, name
        reasons = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}, name
        # vLLM's detokenizer holds back partial characters, so it may send fewer content chunks
        # than tokens, or none before the last one: the layout around them must agree, and every
        # content chunk vLLM does send must have the simulator's shape.
        content = [shape(chunk) for chunk in chunks[:-1]]
        layout = layouts([shape(chunk) for chunk in sse_payloads(response.text)])
        shapes[name] = ([item for item in layout if item not in content], content)
    (sim_layout, sim_content), (vllm_layout, vllm_content) = shapes["sim"], shapes["vllm"]
    assert sim_layout == vllm_layout
    assert len(sim_content) == 3  # one chunk per token before the last
    assert all(item in sim_content for item in vllm_content)


def test_info_routes_agree(engines: dict[str, Served]) -> None:
    models = on_each(engines, lambda engine: engine.http.get("/v1/models").json())
    assert shape(models["sim"]) == shape(models["vllm"])
    for body in models.values():
        assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [("tiny", 2048)]
    versions = on_each(engines, lambda engine: engine.http.get("/version").json())
    assert versions == {"sim": {"version": "0.32.0"}, "vllm": {"version": "0.32.0"}}
    for engine in engines.values():
        health = engine.http.get("/health")
        assert (health.status_code, health.content) == (200, b"")


def test_the_same_prompts_count_the_same_tokens(engines: dict[str, Served]) -> None:
    text = "The quick brown fox jumps over the lazy dog; naïve café 🙂. " * 4
    chat = generation(CHAT, 1, messages=[{"role": "user", "content": text}])
    counts = on_each(
        engines,
        lambda engine: (
            engine.complete(text)["usage"]["prompt_tokens"],
            engine.post(CHAT, chat).json()["usage"]["prompt_tokens"],
        ),
    )
    assert counts["sim"] == counts["vllm"]


def test_a_repeated_prompt_hits_all_but_its_partial_block(engine: Served) -> None:
    engine.reset_prefix_cache()
    prompt = random_prompt(132, seed=1)
    cached = [engine.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    assert cached == [0, 128]
    streamed = engine.post(
        COMPLETIONS,
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    usage = sse_payloads(streamed.text)[-2]["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (132, {"cached_tokens": 128})


def test_chat_usage_agrees_on_cached_and_created_cache_tokens(engines: dict[str, Served]) -> None:
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(60))}]
    chat = generation(CHAT, 2, messages=messages)

    def twice(engine: Served) -> list[dict[str, Any]]:
        engine.reset_prefix_cache()
        return [engine.post(CHAT, chat).json()["usage"] for _ in range(2)]

    usages = on_each(engines, twice)
    assert usages["sim"] == usages["vllm"]
    first, second = usages["sim"]
    full_blocks = first["prompt_tokens"] // 32 * 32
    assert (first["prompt_tokens_details"]["created_cache_tokens"], second["prompt_tokens_details"]) == (
        full_blocks,
        {"cached_tokens": full_blocks, "created_cache_tokens": 0, "multimodal_tokens": None},
    )


@pytest.mark.parametrize(
    "payload",
    [
        {"prompt": "def handler(event):\n    return event  # naïve 🙂"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
        {"messages": MESSAGES, "add_generation_prompt": False},
    ],
    ids=["prompt", "messages", "messages-no-generation-prompt"],
)
def test_tokenize_agrees(engines: dict[str, Served], payload: dict[str, Any]) -> None:
    bodies = on_each(engines, lambda engine: engine.post("/tokenize", {"model": "tiny", **payload}).json())
    assert bodies["sim"] == bodies["vllm"]
    assert bodies["sim"]["count"] == len(bodies["sim"]["tokens"]) > 0, json.dumps(bodies["sim"])
