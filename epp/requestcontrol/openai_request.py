"""Parse an OpenAI-style request body into an :class:`LLMRequest`, as vLLM 0.32 parses it.

For completions and chat completions it reads what routing needs (model, prompt or messages,
stream, max tokens, cache salt) with the types of vLLM's own request models, validated by the
same pydantic in the same (lax) mode: ``"16"``, ``1.0`` and ``true`` are a ``max_tokens`` of 16, 1
and 1, ``"true"``, ``1`` and ``null`` are streams or not, ``[true, 2]`` is the token ids
``[1, 2]``, and a ``model`` omitted, null or empty is the engine's default model (``model`` is
then ``""``). A body vLLM refuses for these fields is refused with vLLM's status, type, message
and ``param``; other fields are vLLM's to check. Prompts longer than the model's context are
refused too (see ``epp.requestcontrol.context_window``). Other paths (embeddings, responses,
tokenize, ...) pass through unparsed and are routed on load alone. The body itself is never
changed.

A batch of prompts (a list of texts, or of token-id lists) is routed as one request on its first
prompt: that prompt's tokens are what the prefix scorers hash and what the context check counts.

Bodies are decoded with orjson rather than ``json``: a lone surrogate (``"\\ud800"``, which the
tokenizer cannot take), a number beyond a double's range (where ``int()`` stops at 4,300 digits;
integers beyond 64 bits become floats) and nesting deeper than 1,024 levels are each a plain
decode error, and it is several times faster on long prompts. What orjson refuses is decoded
again as vLLM's server decodes it (Python's ``json``: UTF-8 with a BOM, UTF-16 and UTF-32 bodies;
``NaN`` and ``Infinity``), and kept if orjson can write it back; a body that is not JSON gets
vLLM's ``json_invalid`` error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from epp.errors import BadRequest, InvalidBody
from epp.requestcontrol.context_window import check_token_ids, encode_prompt
from epp.requestcontrol.request_headers import parse_request_hints
from epp.scheduling.types import ApiKind, LLMRequest
from epp.tokenizer.model import ChatTemplateError, PromptTokenizer
from epp.vllm_wording import cache_salt_refusal, json_invalid_error, with_parameter


def api_kind(path: str) -> ApiKind | None:
    """Which OpenAI API a request path targets (query string ignored), or None if neither."""
    route = path.split("?", 1)[0].rstrip("/")
    if route.endswith("/chat/completions"):
        return ApiKind.CHAT
    if route.endswith("/completions"):
        return ApiKind.COMPLETIONS
    return None


def _refusal(message: str, parameter: str | None = None, value: Any = None) -> BadRequest:
    """A refusal by one of vLLM's own checks, in its words."""
    return BadRequest(with_parameter(message, parameter, value), param=parameter)


TokenIds = list[Annotated[int, Field(ge=0)]]


class _RoutedFields(BaseModel):
    """The fields routing reads, typed as vLLM's request models type them and declared in their
    order (which orders a listing of errors); the rest is ignored."""

    # from_attributes: a body that is not an object is refused in the words vLLM's models use.
    model_config = ConfigDict(extra="ignore", from_attributes=True)

    model: str | None
    max_tokens: int | None
    stream: bool | None
    cache_salt: str | None

    @model_validator(mode="before")
    @classmethod
    def _check_salt(cls, data: Any) -> Any:
        if isinstance(data, dict) and (refusal := cache_salt_refusal(data.get("cache_salt"))) is not None:
            raise _refusal(refusal, "cache_salt")
        return data


class _CompletionFields(_RoutedFields):
    model: str | None = None
    prompt: TokenIds | list[TokenIds] | str | list[str] | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_prompt(cls, data: Any) -> Any:
        # Defined after the salt's check, so run before it, as in vLLM.
        if isinstance(data, dict) and data.get("prompt") in (None, ""):
            raise _refusal("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return data


class _ChatFields(_RoutedFields):
    messages: list[Any]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool | None = False
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_messages(cls, data: Any) -> Any:
        # vLLM iterates the messages before validating them.
        messages = data.get("messages", []) if isinstance(data, dict) else []
        if not isinstance(messages, str | list | dict):
            raise BadRequest(f"'{type(messages).__name__}' object is not iterable")
        return data


def _decode(body: bytes) -> Any:
    """The JSON value of a body, decoded as described in the module's docstring."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        fast_error = exc
    if not body:
        return None  # FastAPI reads an empty body as no body
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise InvalidBody([json_invalid_error(exc.pos, exc.msg)]) from None
    except (ValueError, RecursionError):  # not UTF-8/16/32, over 4,300 digits, too deep
        raise BadRequest("There was an error parsing the body") from None
    try:
        orjson.dumps(data)
    except orjson.JSONEncodeError:  # lone surrogates, integers beyond 64 bits
        raise BadRequest(f"request body is not valid JSON: {fast_error}") from None
    return data


def _validated(model: type[_RoutedFields], data: Any) -> Any:
    if data is None:
        raise InvalidBody([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise InvalidBody([{**error, "loc": ("body", *error["loc"])} for error in errors]) from None


def _check_output_limit(value: int | None, param: str, max_model_len: int | None) -> None:
    """vLLM's first check of the output limit, before it reads the prompt."""
    if value is not None and max_model_len is not None and value > max_model_len:
        raise _refusal(
            f"{param}={value} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            value,
        )


def _check_positive(value: int | None) -> None:
    """vLLM's last check of the output limit, after the prompt's (under either field's name)."""
    if value is not None and value < 1:
        raise _refusal(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)


def _completion_tokens(
    prompt: list[int] | list[list[int]] | str | list[str],
    tokenizer: PromptTokenizer,
    max_model_len: int | None,
    max_chars: int | None,
) -> list[int]:
    if not prompt:
        raise BadRequest("You must pass at least one prompt")
    # A batch of prompts is routed as one request; its first prompt decides the prefix.
    first = prompt if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt[0]
    if isinstance(first, str):
        return encode_prompt(first, tokenizer, max_model_len, max_chars)
    check_token_ids(first, max_model_len)
    return list(first)


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
    ``max_chars``: raise ``epp.tokenizer.cache.TooLongToInline`` rather than tokenize more than
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
            expected_output_tokens=hints.expected_output_tokens,
        )
    data = _decode(body)
    if kind is ApiKind.CHAT:
        chat = _validated(_ChatFields, data)
        if chat.max_completion_tokens is not None:
            max_tokens, param = chat.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = chat.max_tokens, "max_tokens"
        _check_output_limit(max_tokens, param, max_model_len)
        if not chat.messages:
            raise BadRequest(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        try:
            text = tokenizer.render_chat(chat.messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="messages") from None
        fields: _RoutedFields = chat
        tokens = encode_prompt(text, tokenizer, max_model_len, max_chars)
    else:
        completion = _validated(_CompletionFields, data)
        max_tokens = completion.max_tokens
        _check_output_limit(max_tokens, "max_tokens", max_model_len)
        fields = completion
        tokens = _completion_tokens(completion.prompt, tokenizer, max_model_len, max_chars)
    _check_positive(max_tokens)

    return LLMRequest(
        request_id=request_id,
        model=fields.model or "",
        api=kind,
        prompt_token_ids=tokens,
        stream=bool(fields.stream),
        max_tokens=max_tokens,
        headers=headers,
        cache_salt=fields.cache_salt,
        body=data,
        slo_ttft_ms=hints.slo_ttft_ms,
        slo_tpot_ms=hints.slo_tpot_ms,
        priority=hints.priority,
        prediction_based=hints.prediction_based,
        debug=hints.debug,
        expected_output_tokens=hints.expected_output_tokens,
    )
