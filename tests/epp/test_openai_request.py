from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epp.errors import BadRequest
from epp.requestcontrol.openai_request import api_kind, parse_openai_request
from epp.scheduling.types import ApiKind
from epp.tokenization import ModelTokenizer
from tests.hostile_bodies import DEEP_BUT_VALID, HOSTILE, PATHS, request_bodies

TOKENIZER = ModelTokenizer()


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


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{bad json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/completions", {"model": 7, "prompt": "hi"}, "model"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": 12}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "cache_salt": 5}, "cache_salt"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "no role"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"x": 1}]}]},
            "messages",
        ),
    ],
)
def test_invalid_bodies_are_bad_requests(path: str, body: object, param: str | None) -> None:
    raw = body if isinstance(body, bytes) else None
    with pytest.raises(BadRequest) as info:
        parse(path, body, raw=raw)
    assert info.value.param == param
    error = json.loads(info.value.body())["error"]
    assert error["code"] == 400 and error["message"]


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
