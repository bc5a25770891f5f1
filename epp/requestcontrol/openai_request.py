"""Parse an OpenAI-style request body into an :class:`LLMRequest`.

For completions and chat completions it reads what routing needs (model, prompt or
messages, stream, max tokens, cache salt) and rejects bodies vLLM would reject for the same
reasons, with a message naming the field, and prompts longer than the model's context (see
``epp.requestcontrol.context_window``). Other paths (embeddings, responses, tokenize, ...)
pass through unparsed and are routed on load alone. The body itself is never changed.

Bodies are decoded with orjson rather than ``json``: a lone surrogate (``"\\ud800"``, which the
tokenizer cannot take), a number beyond a double's range (where ``int()`` stops at 4,300 digits;
integers beyond 64 bits become floats) and nesting deeper than 1,024 levels are each a plain
decode error, and it is several times faster on long prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from epp.errors import BadRequest
from epp.requestcontrol.context_window import check_token_ids, encode_prompt
from epp.requestcontrol.request_headers import parse_request_hints
from epp.scheduling.types import ApiKind, LLMRequest
from epp.tokenization import ChatTemplateError, PromptTokenizer


def api_kind(path: str) -> ApiKind | None:
    """Which OpenAI API a request path targets (query string ignored), or None if neither."""
    route = path.split("?", 1)[0].rstrip("/")
    if route.endswith("/chat/completions"):
        return ApiKind.CHAT
    if route.endswith("/completions"):
        return ApiKind.COMPLETIONS
    return None


def _decode(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _optional_int(data: Mapping[str, Any], field: str) -> int | None:
    value = data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{field}' must be an integer", param=field)
    if value < 1:
        raise BadRequest(f"'{field}' must be at least 1, got {value}", param=field)
    return value


def _token_ids(prompt: list[Any], max_model_len: int | None) -> list[int]:
    check_token_ids(prompt, max_model_len)
    return list(prompt)


def _completion_tokens(
    prompt: Any, tokenizer: PromptTokenizer, max_model_len: int | None, max_chars: int | None
) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(prompt, tokenizer, max_model_len, max_chars)
    if isinstance(prompt, list) and prompt:
        # A batch of prompts is routed as one request; its first prompt decides the prefix.
        first = prompt[0]
        if isinstance(first, str):
            return encode_prompt(first, tokenizer, max_model_len, max_chars)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return _token_ids(prompt, max_model_len)
        if isinstance(first, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in first):
            return _token_ids(first, max_model_len)
    raise BadRequest("'prompt' must be a non-empty string, list of strings, or token ids", param="prompt")


def parse_openai_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    tokenizer: PromptTokenizer,
    request_id: str,
    objective_priorities: Mapping[str, int] | None = None,
    max_model_len: int | None = None,
    max_chars: int | None = None,
) -> LLMRequest:
    """Build the request the scheduler sees. Raises :class:`BadRequest` for invalid bodies or hints,
    and for prompts over ``max_model_len`` tokens (None: the context length is unknown).
    ``max_chars``: raise ``epp.tokenizer_cache.TooLongToInline`` rather than tokenize more than
    this many characters (see :meth:`ModelTokenizer.encode`)."""
    kind = api_kind(path)
    hints = parse_request_hints(headers, objective_priorities)
    if kind is None:
        return LLMRequest(
            request_id=request_id,
            model="",
            api=ApiKind.OTHER,
            prompt_token_ids=[],
            headers=headers,
            priority=hints.priority,
            prediction_based=hints.prediction_based,
            debug=hints.debug,
        )
    data = _decode(body)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("missing required field 'model' (a non-empty string)", param="model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", param="cache_salt")

    max_tokens = _optional_int(data, "max_tokens")
    if kind is ApiKind.CHAT:
        max_tokens = _optional_int(data, "max_completion_tokens") or max_tokens
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        try:
            text = tokenizer.render_chat(messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="messages") from None
        tokens = encode_prompt(text, tokenizer, max_model_len, max_chars)
    else:
        if "prompt" not in data:
            raise BadRequest("missing required field 'prompt'", param="prompt")
        tokens = _completion_tokens(data["prompt"], tokenizer, max_model_len, max_chars)

    return LLMRequest(
        request_id=request_id,
        model=model,
        api=kind,
        prompt_token_ids=tokens,
        stream=stream,
        max_tokens=max_tokens,
        headers=headers,
        cache_salt=salt,
        body=data,
        slo_ttft_ms=hints.slo_ttft_ms,
        slo_tpot_ms=hints.slo_tpot_ms,
        priority=hints.priority,
        prediction_based=hints.prediction_based,
        debug=hints.debug,
    )
