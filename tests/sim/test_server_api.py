"""The OpenAI API of a live simulated server, checked against recorded vLLM 0.32 responses."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from sim.engine import load_profile
from sim.openai_serving import ServedModel
from sim.server import ServerSettings, create_app
from tests.openai_wire import shape, sse_payloads

from .conftest import running_replica, vllm_error_sample, vllm_samples


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


async def test_openai_client_completions_and_chat(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url):
        client = client_for(url)
        completion = await client.completions.create(model="tiny", prompt="def main():", max_tokens=5)
        assert completion.usage.completion_tokens == 5
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.prompt_tokens == len(served_model.tokenizer.encode("def main():"))

        pieces = []
        stream = await client.completions.create(
            model="tiny",
            prompt="import os",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            pieces.append(chunk)
        assert [c.choices[0].finish_reason for c in pieces[:4]] == [None, None, None, "length"]
        assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == 4

        messages = [{"role": "user", "content": "hello"}]
        chat = await client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6)
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens == 6
        assert chat.usage.prompt_tokens == len(served_model.tokenizer.encode_chat(messages))

        chunks = []
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            chunks.append(chunk)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        content = "".join(c.choices[0].delta.content or "" for c in chunks[1:] if c.choices)
        assert content == served_model.text(_token_ids(served_model, content))
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 3


def _token_ids(served_model: ServedModel, text: str) -> list[int]:
    return served_model.tokenizer.encode(text)


async def test_response_layouts_match_vllm(served_model: ServedModel) -> None:
    samples = vllm_samples()
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        body = (
            await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5})
        ).json()
        assert shape(body) == shape(json.loads(samples["POST /v1/completions non-stream"]))

        messages = [{"role": "user", "content": "hi"}]
        body = (await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})).json()
        assert shape(body) == shape(json.loads(samples["POST /v1/chat/completions non-stream"]))

        completions, chat = "/v1/completions", "/v1/chat/completions"
        cases = [
            (completions, {"prompt": "hi", "max_tokens": 3}, True, "stream with include_usage"),
            (completions, {"prompt": "hi", "max_tokens": 2}, False, "stream without usage"),
            (chat, {"messages": messages, "max_tokens": 2}, True, "stream with usage"),
        ]
        for path, payload, include_usage, title in cases:
            payload = {**payload, "stream": True}
            if include_usage:
                payload["stream_options"] = {"include_usage": True}
            response = await http.post(path, json=payload)
            assert response.headers["content-type"].startswith("text/event-stream")
            ours, theirs = sse_payloads(response.text), sse_payloads(samples[f"POST {path} {title}"])
            assert ours[-1] == theirs[-1] == "[DONE]"
            assert [shape(chunk) for chunk in ours[:-1]] == [shape(chunk) for chunk in theirs[:-1]]


async def test_chat_stream_without_usage_ends_with_fingerprint(served_model: ServedModel) -> None:
    # Recorded live from vLLM 0.32: the finishing chunk carries system_fingerprint.
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        chunks = sse_payloads((await http.post("/v1/chat/completions", json=payload)).text)
        assert [list(chunk) for chunk in chunks[1:3]] == [
            ["id", "object", "created", "model", "choices"],
            ["id", "object", "created", "model", "choices", "system_fingerprint"],
        ]
        assert chunks[2]["choices"][0]["finish_reason"] == "length"


ERROR_CASES = [
    ("bad JSON", "/v1/completions", b'{"model":"tiny","prompt":  }'),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}),
    ("negative max_tokens", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}),
    ("max_tokens wrong type", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "many"}),
    ("missing prompt", "/v1/completions", {"model": "tiny", "max_tokens": 5}),
    ("chat missing messages", "/v1/chat/completions", {"model": "tiny", "max_tokens": 5}),
    ("chat empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}),
    ("prompt too long", "/v1/completions", {"model": "tiny", "prompt": "x = 1\n" * 1500, "max_tokens": 5}),
    ("prompt+max_tokens too long", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5000}),
    ("tokenize bad", "/tokenize", {"model": "tiny"}),
    ("temperature NaN", "/v1/completions", b'{"model":"tiny","prompt":"hi","temperature":NaN}'),
    ("negative temperature", "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -0.5}),
    ("top_p above 1", "/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}),
    ("stop an int", "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 5}),
    ("stop the empty string", "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ""}),
    ("huge logprobs", "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 1000000}),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}),
    ("presence_penalty above 2", "/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 3}),
]  # fmt: skip


@pytest.mark.parametrize(("title", "path", "payload"), ERROR_CASES, ids=[case[0] for case in ERROR_CASES])
async def test_errors_match_vllm(served_model: ServedModel, title: str, path: str, payload: object) -> None:
    expected, status = vllm_error_sample(title)
    async with running_replica(served_model) as (replica, url), httpx.AsyncClient(base_url=url) as http:
        if isinstance(payload, bytes):
            response = await http.post(path, content=payload, headers={"content-type": "application/json"})
        else:
            response = await http.post(path, json=payload)
        assert (response.status_code, response.json()) == (status, expected)
        assert not replica.engine.has_unfinished_requests()
        # The server stays up and serves the next request.
        ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


TOO_LONG = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains {} input tokens, "
    "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
    "(parameter=input_tokens, value={})"
)
TOO_MANY_CHARS = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains {0} characters "
    "(more than 75776 characters, which is the upper bound for 2048 input tokens). Please reduce the length "
    "of the input prompt. (parameter=input_text, value={0})"
)
TOKENIZE_UNION = (
    "2 validation errors:\n  {{'type': '{}', 'loc': 'body.prompt', 'msg': '{}', 'input': '{}'}}\n  "
    "{{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of {} items>'}}"
)
# Answers of vLLM 0.32 on the tiny model (2,048-token context, longest token 37 characters), seen live.
PROMPT_ERROR_CASES = [
    ("/v1/completions", {"prompt": []}, "You must pass at least one prompt", None),
    ("/v1/completions", {"prompt": [""]}, "The decoder prompt cannot be empty", None),
    ("/v1/completions", {"prompt": [[]], "max_tokens": -1}, "max_tokens must be at least 1, got -1. "
     "(parameter=max_tokens, value=-1)", "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 2049}, TOO_LONG.format("at least 2049", 2049), "input_tokens"),
    ("/v1/completions", {"prompt": [5] * 3000}, TOO_LONG.format(3000, 3000), "input_tokens"),
    ("/v1/completions", {"prompt": [2048, 5]}, "Token id 2048 is out of vocabulary", None),
    ("/v1/completions", {"prompt": [99999] * 2048}, "max_tokens must be at least 1, got 0. "
     "(parameter=max_tokens, value=0)", "max_tokens"),
    ("/v1/completions", {"prompt": "a" * 80_000}, TOO_MANY_CHARS.format(80_000), "input_text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 80_000}]},
     TOO_MANY_CHARS.format(80_031), "input_text"),
    ("/tokenize", {"model": "nope"},
     TOKENIZE_UNION.format("missing", "Field required", "<dict of 1 items>", 1), "body.prompt"),
    ("/tokenize", {"prompt": [5, 6]}, TOKENIZE_UNION.format("string_type", "Input should be a valid string",
     "<list of 2 items>", 1), "body.prompt"),
    ("/tokenize", {"prompt": None}, TOKENIZE_UNION.format("string_type", "Input should be a valid string",
     "None", 1), "body.prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "payload", "message", "param"), PROMPT_ERROR_CASES)
async def test_prompt_errors_in_vllms_words_and_order(
    served_model: ServedModel, path: str, payload: dict[str, object], message: str, param: str | None
) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        response = await http.post(path, json=payload)
        error = response.json()["error"]
        assert (response.status_code, error["message"], error["param"]) == (400, message, param)
        assert error["type"] == ("Bad Request" if path == "/tokenize" else "BadRequestError")


async def test_negative_token_ids_fail_the_request_schema(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        error = (await http.post("/v1/completions", json={"prompt": [-1, 5]})).json()["error"]
        assert (error["type"], error["param"]) == ("Bad Request", "body.prompt.0")
        # Every branch of vLLM's prompt union, as vLLM lists them.
        assert error["message"].startswith("6 validation errors:\n  {'type': 'greater_than_equal'")


async def test_other_errors_keep_vllm_shape(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        exact = {"prompt": list(range(2100)), "max_tokens": 3}  # token ids are counted, not truncated
        body = (await http.post("/v1/completions", json=exact)).json()
        assert "your prompt contains 2100 input tokens" in body["error"]["message"]
        full = {"prompt": [300] * 2048}  # no room left for output
        response = await http.post("/v1/completions", json=full)
        assert response.json()["error"]["message"].startswith("max_tokens must be at least 1, got 0.")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
        response = await http.post("/v1/chat/completions", json=chat)
        assert response.json()["error"]["param"] == "max_completion_tokens"
        for payload in (
            {"messages": [{"content": "no role"}]},
            {"messages": "hi"},
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
        ):
            response = await http.post("/v1/chat/completions", json=payload)
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == 400
            assert set(error) == {"message", "type", "param", "code"}
        assert (await http.get("/v1/completions")).json() == {"detail": "Method Not Allowed"}
        assert (await http.get("/nowhere")).status_code == 404
        bad_header = await http.post(
            "/v1/completions", json={"prompt": "hi"}, headers={"x-sim-output-tokens": "soon"}
        )
        assert bad_header.json()["error"]["param"] == "x-sim-output-tokens"


async def test_output_length_defaults_and_early_stop(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as http:
        default = (await http.post("/v1/completions", json={"prompt": "hi"})).json()
        assert default["usage"]["completion_tokens"] == 16
        ids_prompt = (await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})).json()
        assert ids_prompt["usage"]["prompt_tokens"] == 3
        chat = (
            await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        ).json()
        assert chat["usage"]["total_tokens"] == 2048  # chat default: whatever the context leaves
        clamped = (await http.post("/v1/completions", json={"prompt": [9] * 2000, "max_tokens": 100})).json()
        assert clamped["usage"]["completion_tokens"] == 48

        headers = {"x-sim-output-tokens": "3"}
        stopped = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10}, headers=headers)
        assert stopped.json()["usage"]["completion_tokens"] == 3
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"
        ignored = await http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 10, "ignore_eos": True}, headers=headers
        )
        assert ignored.json()["usage"]["completion_tokens"] == 10


async def test_repeated_prompts_report_cached_tokens(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        payload = {"prompt": list(range(300, 432)), "max_tokens": 2}  # 132 tokens, blocks of 32
        usages = [(await http.post("/v1/completions", json=payload)).json()["usage"] for _ in range(2)]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 128]
        salted = (await http.post("/v1/completions", json={**payload, "cache_salt": "other"})).json()
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        text = " ".join(f"word{i}" for i in range(60))
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        first, second = [
            (await http.post("/v1/chat/completions", json=chat)).json()["usage"] for _ in range(2)
        ]
        full_blocks = first["prompt_tokens"] // 32 * 32
        assert first["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": full_blocks,
            "multimodal_tokens": None,
        }
        assert second["prompt_tokens_details"]["cached_tokens"] == full_blocks
        assert second["prompt_tokens_details"]["created_cache_tokens"] == 0

        openai_usage = (await client_for(url).completions.create(model="tiny", **payload)).usage
        assert openai_usage.prompt_tokens_details.cached_tokens == 128


async def test_batches_and_n_get_a_choice_each_numbered_prompt_by_prompt(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (_, url), httpx.AsyncClient(base_url=url) as http:
        payload = {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "ignore_eos": True}
        body = (await http.post("/v1/completions", json=payload)).json()
        assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [
            (i, "length") for i in range(4)
        ]
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (5, 12)

        streamed = await http.post(
            "/v1/completions", json={**payload, "stream": True, "stream_options": {"include_usage": True}}
        )
        chunks = sse_payloads(streamed.text)
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 12
        per_choice = [
            [c["choices"][0]["finish_reason"] for c in chunks[:-2] if c["choices"][0]["index"] == i]
            for i in range(4)
        ]
        assert per_choice == [[None, None, "length"]] * 4
        assert len({c["id"] for c in chunks[:-1]}) == 1

        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 1, "stream": True}
        roles = [
            c["choices"][0]["index"]
            for c in sse_payloads((await http.post("/v1/chat/completions", json=chat)).text)[:-1]
            if "role" in c["choices"][0]["delta"]
        ]
        assert sorted(roles) == [0, 1, 2]


async def test_admin_and_info_routes(served_model: ServedModel) -> None:
    async with running_replica(served_model) as (replica, url), httpx.AsyncClient(base_url=url) as http:
        health = await http.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert (await http.get("/version")).json() == {"version": "0.32.0"}
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
        assert [m.id for m in (await client_for(url).models.list()).data] == ["tiny"]

        tokenized = (await http.post("/tokenize", json={"prompt": "def f(x):"})).json()
        assert tokenized == {
            "count": len(tokenized["tokens"]),
            "max_model_len": 2048,
            "tokens": served_model.tokenizer.encode("def f(x):"),
            "token_strs": None,
        }
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        assert chat["tokens"] == [5, 206, 79, 80, 7, 206, 6, 206]  # as vLLM 0.32 tokenizes it
        unknown = await http.post("/tokenize", json={"model": "x", "prompt": "hi"})
        assert unknown.status_code == 404

        await http.post("/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 1})
        assert replica.engine.kv_cache.num_cached_digests > 0
        assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
        assert replica.engine.kv_cache.num_cached_digests == 0


async def test_app_factory_serves_in_process() -> None:
    app = create_app(ServerSettings(profile="instant"))
    replica = app.state.replica
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert response.json()["usage"]["completion_tokens"] == 4
    assert replica.engine.counters.generation_tokens == 4
    assert replica.engine.config.max_model_len == replica.profile.engine.max_model_len
    await replica.driver.stop()


async def test_a_server_runs_a_profile_variant_of_a_mixed_pool() -> None:
    app = create_app(ServerSettings(profile="default+slowdown=2.5+max_num_seqs=8"))
    replica = app.state.replica
    base = load_profile("default")
    assert replica.engine.config.max_num_seqs == 8
    assert replica.engine.cost_model == base.cost.scaled(2.5)
    await replica.driver.stop()


async def test_long_prompts_are_tokenized_like_short_ones(served_model: ServedModel) -> None:
    text = "def handler(event):\n    return event\n" * 600  # over 16k characters: a worker thread
    async with (
        running_replica(served_model, max_model_len=32768, num_gpu_blocks=2000) as (_, url),
        httpx.AsyncClient(base_url=url) as http,
    ):
        body = (await http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})).json()
        assert body["usage"]["prompt_tokens"] == len(served_model.tokenizer.encode(text))
        tokenized = (await http.post("/tokenize", json={"prompt": text})).json()
        assert tokenized["count"] == body["usage"]["prompt_tokens"]


async def test_engine_speed_changes_at_runtime_from_loopback_only(served_model: ServedModel) -> None:
    async with running_replica(served_model, "default") as (replica, url):
        before = replica.engine.cost_model.step_time(100, 5050, 2, 300, 0.1)
        async with httpx.AsyncClient(base_url=url) as client:
            answer = await client.post("/admin/engine-speed", json={"slowdown": 3})
            assert (answer.status_code, answer.json()) == (200, {"profile": "default", "slowdown": 3.0})
            assert replica.engine.cost_model.step_time(100, 5050, 2, 300, 0.1) == pytest.approx(3 * before)
            other = await client.post("/admin/engine-speed", json={"profile": "instant"})
            assert other.json() == {"profile": "instant", "slowdown": 1.0}
            for bad in ({"slowdown": 0}, {"speed": 2}, {"profile": "no-such-profile"}):
                refused = await client.post("/admin/engine-speed", json=bad)
                assert refused.status_code == 400 and refused.json()["error"]["code"] == 400, bad
    # From beyond loopback: refused, and nothing changes.
    app = create_app(ServerSettings(profile="default"))
    transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        refused = await client.post("/admin/engine-speed", json={"slowdown": 3})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "PermissionDenied"
    replica = app.state.replica
    assert replica.engine.cost_model == replica.profile.cost


async def test_metrics_answer_late_on_request_while_the_engine_serves_on(served_model: ServedModel) -> None:
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    async with (
        running_replica(served_model, "instant") as (_, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        answer = await client.post("/admin/metrics-delay", json={"seconds": 0.4})
        assert (answer.status_code, answer.json()) == (200, {"seconds": 0.4})
        loop = asyncio.get_running_loop()
        started = loop.time()
        scrape = asyncio.ensure_future(client.get("/metrics"))
        served = await client.post("/v1/completions", json=completion)
        assert served.status_code == 200 and not scrape.done()
        assert (await scrape).status_code == 200 and loop.time() - started >= 0.4
        for bad in ({"seconds": -1}, {"delay": 1}):
            refused = await client.post("/admin/metrics-delay", json=bad)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == 400, bad
    app = create_app(ServerSettings(profile="default"))
    transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        refused = await client.post("/admin/metrics-delay", json={"seconds": 3})
    assert refused.status_code == 403 and app.state.replica.metrics_delay_s == 0.0
