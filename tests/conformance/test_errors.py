"""Refused requests: the same status and the same error body (message, type, param, code); and
requests vLLM accepts although they look wrong, accepted alike."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from epp.extproc.envoy_contract import INFERENCE_API_PATHS

from .conftest import Served, on_each

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello world " * 1200  # ~2,400 tokens


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2, **fields}


def raw_completion(field: str, literal: str) -> tuple[str, bytes]:
    """A completion with a field set to a JSON extension literal (NaN, Infinity) that json.dumps
    would not write; both servers' JSON parsers read them as floats."""
    body = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {literal}}}'
    return "/v1/completions", body.encode()


def encoded(path: str, body: dict[str, Any], encoding: str, prefix: bytes = b"") -> tuple[str, bytes]:
    """A body in another encoding than UTF-8, or after a byte-order mark."""
    return path, prefix + json.dumps(body).encode(encoding)


def conversation(*messages: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "tiny", "messages": list(messages), "max_tokens": 2}


TOOL_CALLS = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
HI_COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
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
    # Sampling parameters vLLM refuses, while parsing the body or building its SamplingParams.
    "temperature NaN": raw_completion("temperature", "NaN"),
    "temperature infinite": raw_completion("temperature", "Infinity"),
    "temperature minus infinity": raw_completion("temperature", "-Infinity"),
    "temperature overflowing to infinity": raw_completion("temperature", "1e400"),
    "temperature 'nan' as a string": completion(temperature="nan"),
    "negative temperature": completion(temperature=-0.5),
    "temperature above 2": completion(temperature=2.5),
    "chat negative temperature": chat(temperature=-1),
    "top_p above 1": completion(top_p=1.5),
    "top_p zero": completion(top_p=0),
    "negative top_p": completion(top_p=-0.1),
    "top_p NaN": raw_completion("top_p", "NaN"),
    "top_p above 1 when greedy": completion(top_p=1.5, temperature=0),
    "chat top_p above 1": chat(top_p=2),
    "top_k below -1": completion(top_k=-2),
    "fractional top_k": completion(top_k=1.5),
    "min_p above 1": completion(min_p=1.5),
    "presence_penalty above 2": completion(presence_penalty=3),
    "frequency_penalty below -2": completion(frequency_penalty=-3),
    "repetition_penalty zero": completion(repetition_penalty=0),
    "repetition_penalty NaN": raw_completion("repetition_penalty", "NaN"),
    "negative min_tokens": completion(min_tokens=-1),
    "min_tokens above max_tokens": completion(min_tokens=5),
    "n zero": completion(n=0),
    "seed above int64": completion(seed=2**64),
    "stop an int": completion(stop=5),
    "stop an object": completion(stop={"a": 1}),
    "stop a list of ints": completion(stop=[5]),
    "stop the empty string": completion(stop=""),
    "stop with an empty string": completion(stop=["", "x"]),
    "more than 4 stop strings": completion(stop=["a", "b", "c", "d", "e"]),
    "chat stop an int": chat(stop=5),
    "chat stop an object": chat(stop={"a": 1}),
    "logprobs above the maximum": completion(logprobs=21),
    "huge logprobs": completion(logprobs=10**30),
    "all logprobs": completion(logprobs=-1),
    "logprobs below -1": completion(logprobs=-2),
    "logprobs a string": completion(logprobs="5"),
    "fractional logprobs": completion(logprobs=2.5),
    "prompt_logprobs above the maximum": completion(prompt_logprobs=21),
    "chat top_logprobs above the maximum": chat(logprobs=True, top_logprobs=21),
    "chat huge top_logprobs": chat(logprobs=True, top_logprobs=10**6),
    "chat all top_logprobs": chat(logprobs=True, top_logprobs=-1),
    "chat top_logprobs below -1": chat(logprobs=True, top_logprobs=-2),
    "chat top_logprobs without logprobs": chat(top_logprobs=5),
    "chat logprobs an int": chat(logprobs=5),
    "chat messages a string": ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}),
    # Field types as vLLM's request models (pydantic, lax mode) refuse them.
    "model an int": completion(model=5),
    "stream 2": completion(stream=2),
    "stream a word that is no boolean": completion(stream="x"),
    "fractional max_tokens": completion(max_tokens=1.5),
    "max_tokens a list": completion(max_tokens=[]),
    "zero max_tokens": completion(max_tokens=0),
    "chat fractional max_completion_tokens": chat(max_completion_tokens=1.5),
    "chat zero max_completion_tokens": chat(max_completion_tokens=0),
    "prompt a number": completion(prompt=5),
    "prompt true": completion(prompt=True),
    "prompt an object": completion(prompt={}),
    "prompt null": completion(prompt=None),
    "texts and token ids in one batch": completion(prompt=["hi", [5, 6]]),
    "an empty token-id list in a batch": completion(prompt=[[]]),
    "completion n null": completion(n=None),
    "a batch of 1,025 prompts": completion(prompt=["hi"] * 1025),
    "cache_salt an int": completion(cache_salt=5),
    "cache_salt empty": completion(cache_salt=""),
    "cache_salt with a slash": completion(cache_salt="tenant/a"),
    "cache_salt over 128 characters": completion(cache_salt="s" * 129),
    "body an array": ("/v1/completions", b"[1]"),
    "body a string": ("/v1/completions", b'"hi"'),
    "empty body": ("/v1/completions", b""),
    "chat messages null": ("/v1/chat/completions", {"model": "tiny", "messages": None}),
    "chat messages a number": ("/v1/chat/completions", {"model": "tiny", "messages": 5}),
    "chat tools not a list": chat(tools=5),
    "chat tools a list of numbers": chat(tools=[5]),
    "chat a tool without a function": chat(tools=[{}]),
    "chat tools empty": chat(tools=[]),
    "chat tools choosing auto by default": chat(tools=TOOLS),
    "chat tool_choice required": chat(tools=TOOLS, tool_choice="required"),
    "chat tool_choice without tools": chat(tool_choice="required"),
    "logit_bias not an object": completion(logit_bias=5),
    "logit_bias keyed by a word": completion(logit_bias={"a": 1}),
    "chat logit_bias a list": chat(logit_bias=[1]),
}  # fmt: skip
# Refused by both, in words that differ: vLLM lists each of its response-format and message types
# (the simulator has fewer), iterates tool calls lazily, and answers a body that is no text or a
# JSON null in FastAPI's words.
REFUSED_ALIKE = {
    "response_format not an object": completion(response_format=5),
    "chat response_format of no known type": chat(response_format={"type": "x"}),
    "tool_calls not a list": conversation(
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}),
    "tool_calls a list of numbers": conversation(
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [5]}),
    "a message name that is a number": conversation({"role": "user", "content": "hi", "name": 5}),
    "body null": ("/v1/completions", b"null"),
    "a Latin-1 body": ("/v1/completions", '{"model": "tiny", "prompt": "h\xe9"}'.encode("latin-1")),
}  # fmt: skip
# Malformed chat messages. vLLM lists every way the message fails each of its eight message types
# (OpenAI's, its own, Harmony's), naming them; the simulator has the three types that decide what
# is accepted. The same refusal, then: status, type, code, and the param and the kind of message
# once the type names are left out.
MALFORMED_MESSAGES = {
    "a role that is not a string": conversation({"role": 5, "content": "hi"}),
    "no role": conversation({"content": "hi"}),
    "null content from the user": conversation({"role": "user", "content": None}),
    "content a number": conversation({"role": "user", "content": 5}),
    "content an object": conversation({"role": "user", "content": {"a": 1}}),
    "content parts of no known type": conversation({"role": "user", "content": [{"type": "bogus"}]}),
    "a message that is a string": conversation("hi"),
    "a message that is a list": conversation(["hi"]),
}  # fmt: skip
# Requests that look wrong but that vLLM 0.32 serves (its message type for custom roles takes any
# role and optional content; the tiny model's chat template renders them), and valid edge values.
ACCEPTED = {
    "an unknown role": conversation({"role": "wizard", "content": "hi"}),
    "a user message without content": conversation({"role": "user"}),
    "an assistant message without content": conversation(
        {"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "hi"}),
    "an assistant message with null content": conversation(
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}),
    "an assistant message with tool calls and no content": conversation(
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": TOOL_CALLS}),
    "a tool message without a call id": conversation(
        {"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}),
    "a function message with null content": conversation({"role": "function", "name": "f", "content": None}),
    "temperature 0": completion(temperature=0),
    "temperature 2": completion(temperature=2),
    "top_p 1": completion(top_p=1),
    "logprobs at the maximum": completion(logprobs=20),
    "logprobs true": completion(logprobs=True),
    "chat top_logprobs null": chat(logprobs=True, top_logprobs=None),
    "4 stop strings": completion(stop=["a", "b", "c", "d"]),
    "null sampling parameters": completion(temperature=None, top_p=None, stop=None, logprobs=None),
    # Bodies vLLM's request models read by pydantic's lax rules, or its JSON decoder reads.
    "no model": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "model null": completion(model=None),
    "model empty": completion(model=""),
    "chat model null": chat(model=None),
    "stream null": completion(stream=None),
    "stream 0": completion(stream=0),
    "stream 1": completion(stream=1),
    "stream 'true'": completion(stream="true"),
    "chat stream 'true'": chat(stream="true"),
    "max_tokens '16'": completion(max_tokens="16"),
    "max_tokens 1.0": completion(max_tokens=1.0),
    "max_tokens 1e0": raw_completion("max_tokens", "1e0"),
    "max_tokens true": completion(max_tokens=True),
    "max_tokens null": completion(max_tokens=None),
    "chat max_completion_tokens '3'": chat(max_completion_tokens="3"),
    "a UTF-8 byte-order mark": encoded("/v1/completions", HI_COMPLETION, "utf-8", b"\xef\xbb\xbf"),
    "chat after a UTF-8 byte-order mark": encoded(
        "/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2}, "utf-8", b"\xef\xbb\xbf"),
    "UTF-16": encoded("/v1/completions", HI_COMPLETION, "utf-16"),
    "UTF-16 without a byte-order mark": encoded("/v1/completions", HI_COMPLETION, "utf-16-le"),
    "UTF-32": encoded("/v1/completions", HI_COMPLETION, "utf-32"),
    "NaN in a field vLLM does not know": raw_completion("x", "NaN"),
    "token ids [true, 2]": completion(prompt=[True, 2]),
    "token ids as a float and a string": completion(prompt=[1.0, "2"]),
    "a batch of texts": completion(prompt=["hi", "there"]),
    "a batch of token-id lists": completion(prompt=[[5, 6], [7, 8, 9]]),
    "n 2": completion(n=2),
    "n '2'": completion(n="2"),
    "n 2 streamed": completion(n=2, stream=True),
    "chat n 2": chat(n=2),
    "chat n null": chat(n=None),
    "a batch of two, two choices each, streamed": completion(prompt=["hi", "there"], n=2, stream=True),
    "cache_salt": completion(cache_salt="tenant-a"),
    "chat tools with tool_choice none": chat(tools=TOOLS, tool_choice="none"),
    "logit_bias keyed by token ids": completion(logit_bias={"5": 1.5}),
    "response_format text": chat(response_format={"type": "text"}),
    "a message with a name": conversation({"role": "user", "content": "hi", "name": "bob"}),
}  # fmt: skip


def send(engine: Served | httpx.Client, path: str, payload: object) -> tuple[int, Any]:
    http = engine if isinstance(engine, httpx.Client) else engine.http
    if isinstance(payload, bytes):
        response = http.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=payload)
    is_json = response.headers.get("content-type", "").startswith("application/json")
    return response.status_code, response.json() if is_json else response.text


def send_get(engine: Served, path: str) -> tuple[int, Any]:
    response = engine.http.get(path)
    return response.status_code, response.json()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_error(engines: dict[str, Served], case: str) -> None:
    path, payload = CASES[case]
    answers = on_each(engines, lambda engine: send(engine, path, payload))
    status, body = answers["vllm"]
    assert status in (400, 404) and set(body["error"]) == {"message", "type", "param", "code"}
    assert answers["sim"] == answers["vllm"]


def refusal_kind(answer: tuple[int, Any]) -> tuple[Any, ...]:
    """An error answer without the names of message types (CamelCase segments of ``param``) and
    with its message reduced to its kind (a validation-error listing or not)."""
    status, body = answer
    error = body["error"]
    param = error["param"] and re.sub(r"\.[A-Z]\w*", "", error["param"])
    listing = re.match(r"\d+ validation errors?:\n", error["message"]) is not None
    return status, error["type"], error["code"], param, listing


@pytest.mark.parametrize("case", list(MALFORMED_MESSAGES))
def test_the_same_refusal_of_a_malformed_message(engines: dict[str, Served], case: str) -> None:
    path, payload = MALFORMED_MESSAGES[case]
    answers = on_each(engines, lambda engine: send(engine, path, payload))
    assert answers["vllm"][0] == 400
    assert refusal_kind(answers["sim"]) == refusal_kind(answers["vllm"])


@pytest.mark.parametrize("case", list(REFUSED_ALIKE))
def test_the_same_refusal_status(engines: dict[str, Served], case: str) -> None:
    path, payload = REFUSED_ALIKE[case]
    statuses = on_each(engines, lambda engine: send(engine, path, payload)[0])
    assert statuses == {"sim": 400, "vllm": 400}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_the_same_acceptance(engines: dict[str, Served], case: str) -> None:
    path, payload = ACCEPTED[case]
    statuses = on_each(engines, lambda engine: send(engine, path, payload)[0])
    assert statuses == {"sim": 200, "vllm": 200}


def test_a_missing_model_name_is_accepted(engines: dict[str, Served]) -> None:
    unnamed = {"prompt": "hi", "max_tokens": 2}
    answers = on_each(engines, lambda engine: send(engine, "/v1/completions", unnamed))
    assert {name: (status, body["model"]) for name, (status, body) in answers.items()} == {
        "sim": (200, "tiny"),
        "vllm": (200, "tiny"),
    }


@pytest.mark.parametrize(
    "fields",
    [{"n": 3}, {"prompt": ["hi", "there", "you"]}, {"prompt": [[5, 6], [7, 8, 9]], "n": 2}],
)
def test_choices_of_batches_and_n_are_numbered_and_counted_alike(
    engines: dict[str, Served], fields: dict[str, Any]
) -> None:
    path, payload = completion(max_tokens=3, ignore_eos=True, **fields)

    def answer(engine: Served) -> tuple[list[Any], dict[str, Any]]:
        status, body = send(engine, path, payload)
        assert status == 200, body
        usage = {key: body["usage"][key] for key in ("prompt_tokens", "completion_tokens")}
        return [(choice["index"], choice["finish_reason"]) for choice in body["choices"]], usage

    answers = on_each(engines, answer)
    assert answers["sim"] == answers["vllm"]


def test_a_wrong_method_gets_the_same_answer(engines: dict[str, Served]) -> None:
    answers = on_each(engines, lambda engine: send_get(engine, "/v1/completions"))
    # vLLM answers in FastAPI's words here, not in the OpenAI shape; so does the simulator.
    assert answers == {name: (405, {"detail": "Method Not Allowed"}) for name in engines}


# The gateway routes only the inference paths (a 404 for /tokenize is its own answer).
EVERY_BODY = {
    case: (path, payload)
    for case, (path, payload) in {**CASES, **MALFORMED_MESSAGES, **REFUSED_ALIKE, **ACCEPTED}.items()
    if path in INFERENCE_API_PATHS
}


@pytest.mark.parametrize("case", list(EVERY_BODY))
def test_the_gateway_answers_every_body_with_vllms_status(
    engines: dict[str, Served], gateway: httpx.Client, case: str
) -> None:
    path, payload = EVERY_BODY[case]
    assert send(gateway, path, payload)[0] == send(engines["vllm"], path, payload)[0]
