from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.errors import BadRequest
from epp.requestcontrol.openai_request import api_kind, parse_openai_request
from epp.scheduling.types import ApiKind
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from tests.hostile_bodies import DEEP_BUT_VALID, HOSTILE, PATHS, request_bodies

TOKENIZER = ModelTokenizer(TINY_MODEL_DIR)


def parse(path: str, body: object, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    return parse_openai_request(path, {}, data, TOKENIZER, "rid")


def test_api_kind_by_path_suffix() -> None:
    assert api_kind("/v1/chat/completions?x=1") is ApiKind.CHAT
    assert api_kind("/v1/completions/") is ApiKind.COMPLETIONS
    assert api_kind("/v1/embeddings") is None


def test_completion_prompt_is_tokenized_like_the_engine() -> None:
    request = parse("/v1/completions", {"model": "tiny", "prompt": "Hello world", "max_tokens": 5})
    assert request.prompt_token_ids == [47, 538, 343, 1240, 1383]  # vLLM's /tokenize said so
    assert (request.model, request.max_tokens, request.stream) == ("tiny", 5, False)


def test_chat_uses_the_chat_template_and_max_completion_tokens() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 7,
        "max_tokens": 3,
        "stream": True,
    }
    request = parse("/v1/chat/completions", body)
    assert request.prompt_token_ids == [5, 206, 47, 80, 7, 206, 6, 206]
    assert (request.api, request.max_tokens, request.stream) == (ApiKind.CHAT, 7, True)


def test_token_id_prompts_and_batches() -> None:
    assert parse("/v1/completions", {"model": "m", "prompt": [5, 6, 7]}).prompt_token_ids == [5, 6, 7]
    assert parse("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]]}).prompt_token_ids == [1, 2]
    first = parse("/v1/completions", {"model": "m", "prompt": ["Hello world", "x"]})
    assert first.prompt_token_ids == TOKENIZER.encode("Hello world")


def test_other_paths_pass_through_unparsed() -> None:
    request = parse("/v1/embeddings", None, raw=b"not even json")
    assert request.api is ApiKind.OTHER and request.prompt_token_ids == []


INVALID = "Bad Request"  # vLLM's type for a body that fails validation
CHECK = "BadRequestError"  # vLLM's type for a refusal by one of its own checks


@pytest.mark.parametrize(
    ("path", "body", "param", "error_type"),
    [
        ("/v1/completions", b"{bad json", "body.1", INVALID),
        ("/v1/completions", b"[1, 2]", "body", INVALID),
        ("/v1/completions", b"null", "body", INVALID),
        ("/v1/completions", b"", "body", INVALID),
        ("/v1/completions", b"\xff\xfe", "body.0", INVALID),
        ("/v1/completions", '{"model": "m", "prompt": "h\xe9"}'.encode("latin-1"), None, CHECK),
        ("/v1/completions", {"model": 7, "prompt": "hi"}, "body.model", INVALID),
        ("/v1/completions", {"model": "m"}, "prompt", CHECK),
        ("/v1/completions", {"model": "m", "prompt": ""}, "prompt", CHECK),
        ("/v1/completions", {"model": "m", "prompt": 12}, "body.prompt", INVALID),
        ("/v1/completions", {"model": "m", "prompt": [True, "a"]}, "body.prompt.1", INVALID),
        ("/v1/completions", {"model": "m", "prompt": [-1]}, "body.prompt.0", INVALID),
        ("/v1/completions", {"model": "m", "prompt": []}, None, CHECK),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens", CHECK),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "many"}, "body.max_tokens", INVALID),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1.5}, "body.max_tokens", INVALID),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stream": 2}, "body.stream", INVALID),
        ("/v1/completions", {"model": "m", "prompt": "hi", "cache_salt": 5}, "cache_salt", CHECK),
        ("/v1/completions", {"model": "m", "prompt": "hi", "cache_salt": ""}, "cache_salt", CHECK),
        ("/v1/completions", {"model": "m", "prompt": "hi", "cache_salt": "a/b"}, "cache_salt", CHECK),
        ("/v1/completions", {"model": "m", "prompt": "hi", "cache_salt": "s" * 129}, "cache_salt", CHECK),
        ("/v1/chat/completions", {"model": "m"}, "body.messages", INVALID),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "body.messages", INVALID),
        ("/v1/chat/completions", {"model": "m", "messages": None}, None, CHECK),
        ("/v1/chat/completions", {"model": "m", "messages": []}, None, CHECK),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "no role"}]}, "messages", CHECK),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"x": 1}]}]},
            "messages",
            CHECK,
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_tokens",
            CHECK,
        ),
    ],
)
def test_invalid_bodies_are_refused_in_vllms_words(
    path: str, body: object, param: str | None, error_type: str
) -> None:
    raw = body if isinstance(body, bytes) else None
    with pytest.raises(BadRequest) as info:
        parse(path, body, raw=raw)
    error = json.loads(info.value.body())["error"]
    assert (error["param"], error["type"], error["code"]) == (param, error_type, 400)
    assert error["message"]


def test_a_validation_failure_lists_its_errors_as_vllm_does() -> None:
    with pytest.raises(BadRequest) as info:
        parse("/v1/completions", {"prompt": "hi", "max_tokens": "x", "stream": "q"})
    assert info.value.message == (
        "2 validation errors:\n"
        "  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, "
        "unable to parse string as an integer', 'input': 'x'}\n"
        "  {'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid boolean, "
        "unable to interpret input', 'input': 'q'}"
    )  # vLLM 0.32's answer to this body, word for word


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 65}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "100000000000000000000000000000"}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 65},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_completion_tokens": 65},
            "max_completion_tokens",
        ),
    ],
)
def test_an_output_limit_over_the_context_is_refused_when_the_context_is_known(
    path: str, body: dict, param: str
) -> None:
    raw = json.dumps(body).encode()
    with pytest.raises(BadRequest) as info:
        parse_openai_request(path, {}, raw, TOKENIZER, "rid", max_model_len=64)
    assert info.value.param == param
    assert (
        info.value.message.startswith(f"{param}=")
        and "cannot be greater than max_model_len=64" in info.value.message
    )
    assert parse_openai_request(path, {}, raw, TOKENIZER, "rid").max_tokens == int(
        body.get("max_completion_tokens") or body["max_tokens"]
    )


def test_vllms_own_checks_are_worded_as_vllm_words_them() -> None:
    with pytest.raises(BadRequest) as info:
        parse("/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert info.value.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    with pytest.raises(BadRequest) as info:
        parse("/v1/completions", {"prompt": "hi", "cache_salt": "a@b"})
    assert info.value.message == (
        "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
        "or NUL. (parameter=cache_salt)"
    )


HI = json.dumps({"model": "tiny", "prompt": "hi"})


@pytest.mark.parametrize(
    ("fields", "raw", "expected"),
    [
        ({"model": None}, None, ("", False, None)),
        ({"model": ""}, None, ("", False, None)),
        ({"model": "tiny", "stream": None}, None, ("tiny", False, None)),
        ({"model": "tiny", "stream": 0}, None, ("tiny", False, None)),
        ({"model": "tiny", "stream": 1}, None, ("tiny", True, None)),
        ({"model": "tiny", "stream": "true"}, None, ("tiny", True, None)),
        ({"model": "tiny", "max_tokens": "16"}, None, ("tiny", False, 16)),
        ({"model": "tiny", "max_tokens": 1.0}, None, ("tiny", False, 1)),
        ({"model": "tiny", "max_tokens": True}, None, ("tiny", False, 1)),
        ({"model": "tiny", "max_tokens": None}, None, ("tiny", False, None)),
        (None, b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e0}', ("tiny", False, 1)),
        (None, b"\xef\xbb\xbf" + HI.encode(), ("tiny", False, None)),
        (None, HI.encode("utf-16"), ("tiny", False, None)),
        (None, HI.encode("utf-16-le"), ("tiny", False, None)),
        (None, HI.encode("utf-32"), ("tiny", False, None)),
        (None, b'{"model": "tiny", "prompt": "hi", "temperature": 1, "x": NaN}', ("tiny", False, None)),
    ],
)
def test_bodies_vllm_serves_are_read_as_vllm_reads_them(fields, raw, expected) -> None:
    request = parse("/v1/completions", {"prompt": "hi", **(fields or {})}, raw=raw)
    assert (request.model, request.stream, request.max_tokens) == expected
    assert request.prompt_token_ids == TOKENIZER.encode("hi")


def test_a_missing_model_is_the_engines_default() -> None:
    assert parse("/v1/completions", {"prompt": "hi"}).model == ""


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ([True, 2], [1, 2]),
        ([1.0, "2"], [1, 2]),
        ([[True, 2], [3]], [1, 2]),
        (["Hello world", "x"], TOKENIZER.encode("Hello world")),
        ([[5, 6], [7, 8]], [5, 6]),
        ([[]], []),
        ([""], []),
    ],
)
def test_token_ids_are_coerced_and_a_batch_routes_on_its_first_prompt(prompt, tokens) -> None:
    assert parse("/v1/completions", {"model": "m", "prompt": prompt}).prompt_token_ids == tokens


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_are_bad_requests(case: str) -> None:
    path, body = HOSTILE[case]
    with pytest.raises(BadRequest) as info:
        parse(path, None, raw=body)
    error = json.loads(info.value.body())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400


def test_nesting_within_the_decoders_limit_is_parsed() -> None:
    path, body = DEEP_BUT_VALID
    assert parse(path, None, raw=body).prompt_token_ids == TOKENIZER.encode_chat(
        [{"role": "user", "content": "hi"}]
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=PATHS, body=request_bodies(), max_model_len=st.none() | st.integers(1, 64))
def test_any_body_is_a_request_or_a_bad_request(path: str, body: bytes, max_model_len: int | None) -> None:
    try:
        request = parse_openai_request(path, {}, body, TOKENIZER, "rid", max_model_len=max_model_len)
    except BadRequest as error:
        assert set(json.loads(error.body())["error"]) == {"message", "type", "param", "code"}
        return
    assert all(type(t) is int for t in request.prompt_token_ids)
    if max_model_len is not None:
        assert request.input_tokens <= max_model_len


def test_the_expected_output_hint_reaches_the_request_and_a_bad_one_is_a_400() -> None:
    body = json.dumps({"model": "m", "prompt": "Hi"}).encode()
    hinted = parse_openai_request(
        "/v1/completions", {"x-expected-output-tokens": "300"}, body, TOKENIZER, "r"
    )
    assert (
        hinted.expected_output_tokens == 300
        and parse("/v1/completions", {"prompt": "Hi"}).expected_output_tokens is None
    )
    with pytest.raises(BadRequest) as info:
        parse_openai_request("/v1/completions", {"x-expected-output-tokens": "lots"}, body, TOKENIZER, "r")
    assert info.value.status == 400 and info.value.param == "x-expected-output-tokens"
