"""OpenAI-compatible request models, response bodies and error bodies, shaped like vLLM 0.32's.

The shapes (field names, order, nulls) follow responses recorded from vLLM 0.32 on the tiny
model (``tests/fixtures/vllm-0.32/samples.txt``), so clients and routers parse the simulator
exactly as they parse vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, Required

from pydantic import BaseModel, ConfigDict, Field, model_validator, with_config
from starlette.responses import JSONResponse
from typing_extensions import TypedDict  # pydantic needs this one, not typing's, before 3.12

from epp.vllm_wording import VALIDATION_ERROR_TYPE, cache_salt_refusal, validation_error_text, with_parameter

VLLM_VERSION = "0.32.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-sim"


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COMPLETION_PROMPTS = 1024
"""vLLM's default ``VLLM_MAX_COMPLETION_PROMPTS``: the most prompts in one completion's batch."""
MAX_STOP_STRINGS = 4
"""vLLM's default ``VLLM_MAX_STOP_STRINGS``."""
StopParam = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class ResponseFormat(BaseModel):
    """vLLM's ``response_format``: accepted when well-formed; the simulator does not constrain
    its output."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """A tool a chat request offers; the simulated model never calls one."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class GenerationRequest(BaseModel):
    """Fields shared by completion and chat requests, typed as vLLM types them (so a value of the
    wrong type gets pydantic's error in vLLM's words); range checks are ``sim.sampling_checks``."""

    # vLLM accepts (and ignores) fields it does not know; so does the simulator.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop: StopParam = []
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_cache_salt(cls, data: Any) -> Any:
        if isinstance(data, dict) and (refusal := cache_salt_refusal(data.get("cache_salt"))) is not None:
            raise bad_request(refusal, parameter="cache_salt")
        return data


TokenId = Annotated[int, Field(ge=0)]


def _check_logprob_fields(data: Any, fields: tuple[str, ...]) -> None:
    """vLLM's checks of the logprob fields, run on the raw body before any field is parsed: an
    integer (or a float, which then fails as a non-integer), and -1 ("all") or >= 0."""
    for name in fields:
        value = data.get(name)
        if value is not None and not isinstance(value, int | float):
            raise bad_request(f"`{name}` must be an integer.", parameter=name, value=value)
    if (prompt_logprobs := data.get("prompt_logprobs")) is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise bad_request(
                "`prompt_logprobs` are not available when `stream=True`.", parameter="prompt_logprobs"
            )
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise bad_request(
                "`prompt_logprobs` must be a positive value or -1.",
                parameter="prompt_logprobs",
                value=prompt_logprobs,
            )


class CompletionRequest(GenerationRequest):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_logprob_fields(data, ("prompt_logprobs", "logprobs"))
            if (logprobs := data.get("logprobs")) is not None and logprobs < 0 and logprobs != -1:
                raise bad_request(
                    "`logprobs` must be a positive value or -1.", parameter="logprobs", value=logprobs
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_batch_size(cls, data: Any) -> Any:
        # Defined last, so run first, as in vLLM.
        prompt = data.get("prompt") if isinstance(data, dict) else None
        too_many = isinstance(prompt, list) and len(prompt) > MAX_COMPLETION_PROMPTS
        if too_many and not all(isinstance(item, int) for item in prompt):  # token ids are one prompt
            raise bad_request(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                "VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                parameter="prompt",
            )
        return data

    def sample_logprobs(self) -> int | None:
        """The logprobs asked for per generated token (None: none), as vLLM's SamplingParams has it."""
        return self.logprobs


# A chat message is accepted if vLLM accepts it: vLLM's message types include one for any role
# (content a string or a list of parts, or absent), and the assistant's and the function's, whose
# content may be null. vLLM also takes any other iterable as a list of parts, and so refuses a
# mapping only when it renders the chat (``ChatTemplateError`` here). Other fields pass through
# to the chat template unchecked.
_MessageContent = str | list[Any] | dict[str, Any]


@with_config(ConfigDict(extra="allow"))
class ChatMessage(TypedDict):
    role: Required[str]
    content: NotRequired[_MessageContent]
    name: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]] | None]


@with_config(ConfigDict(extra="allow"))
class AssistantMessage(TypedDict):
    role: Required[Literal["assistant"]]
    content: NotRequired[_MessageContent | None]
    name: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]] | None]


@with_config(ConfigDict(extra="allow"))
class FunctionMessage(TypedDict):
    role: Required[Literal["function"]]
    name: Required[str]
    content: Required[str | None]


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage | AssistantMessage | FunctionMessage]
    n: int | None = 1  # a chat request may say null, a completion may not (vLLM 0.32)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int = 0

    @model_validator(mode="before")
    @classmethod
    def _check_tool_usage(cls, data: Any) -> Any:
        """vLLM's checks of ``tools`` and ``tool_choice`` (named tools are not checked further);
        tools without a ``tool_choice`` choose ``"auto"``."""
        if not isinstance(data, dict):
            return data
        if data.get("tools") == []:
            raise bad_request(
                "`tools` must not be an empty array. Either provide at least one tool or omit the "
                "field entirely.",
                parameter="tools",
            )
        if "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if data.get("tools") is None:
            raise bad_request("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise bad_request(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                '"required" are supported.',
                parameter="tool_choice",
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_messages(cls, data: Any) -> Any:
        # vLLM iterates the messages before validating them.
        messages = data.get("messages", []) if isinstance(data, dict) else []
        if not isinstance(messages, str | list | dict):
            raise ApiError(400, "BadRequestError", f"'{type(messages).__name__}' object is not iterable")
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_logprob_fields(data, ("prompt_logprobs", "top_logprobs"))
            if (top_logprobs := data.get("top_logprobs")) is not None:
                if top_logprobs < 0 and top_logprobs != -1:
                    raise bad_request(
                        "`top_logprobs` must be a positive value or -1.",
                        parameter="top_logprobs",
                        value=top_logprobs,
                    )
                if (top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs"):
                    raise bad_request(
                        "when using `top_logprobs`, `logprobs` must be set to true.", parameter="top_logprobs"
                    )
            if data.get("top_logprobs", 0) is None:
                data = {**data, "top_logprobs": 0}  # null means omitted, as in OpenAI's spec
        return data

    def sample_logprobs(self) -> int | None:
        """The logprobs asked for per generated token (None: none), as vLLM's SamplingParams has it."""
        return self.top_logprobs if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: Any = None
    """A string; anything else is refused by ``OpenAIServing.tokenize`` in vLLM's words."""
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered as vLLM does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, error_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.error_type, self.message, self.param)


def bad_request(message: str, *, parameter: str | None = None, value: Any = None) -> ApiError:
    """A 400 worded like vLLM's validation errors: the message, then ``(parameter=..., value=...)``."""
    return ApiError(400, "BadRequestError", with_parameter(message, parameter, value), parameter)


def model_not_found(model: str, served_model_name: str) -> ApiError:
    return ApiError(
        404,
        "NotFoundError",
        f"The model `{model}` does not exist. Valid aliases: {served_model_name}.",
        "model",
    )


def error_response(status: int, error_type: str, message: str, param: str | None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def validation_error_response(errors: Sequence[dict[str, Any]]) -> JSONResponse:
    """A request-body validation failure in vLLM's words: a count, then each error, 400."""
    message, param = validation_error_text(errors)
    return error_response(400, VALIDATION_ERROR_TYPE, message, param)


# ---------------------------------------------------------------- responses


Choice = tuple[str, str]
"""A finished choice: its text and its finish reason."""


def sse(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def dumps(payload: dict[str, Any]) -> str:
    """Compact JSON, UTF-8 text kept as is (as pydantic writes it)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, created_cache_tokens: int | None
) -> dict[str, Any]:
    """The ``usage`` of a non-streamed response; ``created_cache_tokens`` is None for completions."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": created_cache_tokens,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }


def stream_usage_chunk(
    response_id: str,
    object_name: str,
    created: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    created_cache_tokens: int | None,
) -> dict[str, Any]:
    """The final ``choices: []`` chunk that ``stream_options.include_usage`` asks for."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if created_cache_tokens is not None:
        details["created_cache_tokens"] = created_cache_tokens
    return {
        "id": response_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": details,
        },
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def completion_response(
    response_id: str, created: int, model: str, choices: Sequence[Choice], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for index, (text, finish_reason) in enumerate(choices)
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_body,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    response_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    fingerprint: bool,
) -> dict[str, Any]:
    """One streamed completion token; vLLM puts ``system_fingerprint`` on the last chunk only
    when no usage chunk follows."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }
    if fingerprint:
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
    return chunk


def chat_response(
    response_id: str, created: int, model: str, choices: Sequence[Choice], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            for index, (content, finish_reason) in enumerate(choices)
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_body,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_role_chunk(response_id: str, created: int, model: str, index: int) -> dict[str, Any]:
    """The first chunk of a chat stream's choice: the role, no content yet."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def chat_content_chunk(
    response_id: str,
    created: int,
    model: str,
    index: int,
    content: str,
    finish_reason: str | None,
    *,
    fingerprint: bool,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": content},
        "logprobs": None,
        "finish_reason": None,
    }
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = None
    choice["token_ids"] = None
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if fingerprint:
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
    return chunk


def models_response(served_model_name: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": served_model_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": "modelperm-sim",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
