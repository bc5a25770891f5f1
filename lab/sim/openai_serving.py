"""The OpenAI endpoints of one simulated server: request checks, engine requests, responses.

Requests are checked with vLLM 0.32's wording and in its order where it matters: the body's
fields (types, and the logprob fields' signs, as the request models parse it); the model name
(404); an output limit above ``max_model_len``; the prompt (missing, an empty batch, a text longer
than any ``max_model_len`` tokens can spell, more than ``max_model_len`` tokens); the sampling
parameters (``sim.sampling_checks``), among them the output length actually left,
``min(max_model_len - prompt, max_tokens)``, which must be at least 1 (so a long prompt silently
shortens the output, as in vLLM); the logprobs asked for; and last the token ids (an empty prompt
in a batch of one, ids outside the vocabulary).

A completion may carry a batch of prompts (texts or token-id lists), and any request may ask for
``n`` choices per prompt: each choice is its own engine request, answered as one response whose
choices are numbered prompt by prompt (``index = prompt * n + choice``), as vLLM numbers them;
``usage`` counts each prompt's tokens once and every choice's output.

The simulated model never stops on its own: a request generates ``max_tokens`` tokens. The
``x-sim-output-tokens: N`` header makes it stop after N tokens with ``finish_reason: "stop"``,
as if the model had emitted EOS there (``ignore_eos: true`` disables it, as it disables EOS).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from epp.tokenizer.model import GIL_FREE_CHARS, ChatTemplateError, ModelTokenizer
from sim.driver import EngineDeadError, EngineDriver, RequestStream
from sim.engine import EngineRequest, FrontendTerms, RequestOutput, RequestRejectedError
from sim.openai_api import (
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    TokenizeRequest,
    bad_request,
    chat_content_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    model_not_found,
    sse,
    stream_usage_chunk,
    usage,
)
from sim.sampling_checks import check_logprob_limits, check_sampling

SIM_OUTPUT_TOKENS_HEADER = "x-sim-output-tokens"


class ServedModel:
    """The tokenizer of the served model and what generation needs from it, shared by replicas.

    ``root`` is what ``/v1/models`` names as the model (vLLM: what ``vllm serve`` was given).
    """

    def __init__(self, tokenizer: ModelTokenizer, name: str, root: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.root = root
        # Each generated token's text is its own decode, computed once per vocabulary entry.
        self.token_texts = [tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size)]
        special = tokenizer.special_token_ids
        # Generate only tokens that are whole text on their own (not special, not a fragment of a
        # multi-byte character), so streamed pieces join up to the full text.
        self.output_vocab = [
            token_id
            for token_id, text in enumerate(self.token_texts)
            if token_id not in special and text and "\ufffd" not in text
        ]

    def text(self, token_ids: Sequence[int]) -> str:
        texts = self.token_texts
        return "".join(texts[token_id] for token_id in token_ids)


@dataclass(slots=True)
class _Generation:
    """A checked request on its way through the engine: an engine request per choice, ``n`` per
    prompt, prompt by prompt."""

    response_id: str
    requests: list[EngineRequest]
    n: int
    chat: bool
    include_usage: bool
    created: int

    @property
    def _firsts(self) -> list[EngineRequest]:
        """One request per prompt (its choices share the prompt)."""
        return self.requests[:: self.n]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(request.num_prompt_tokens for request in self._firsts)

    @property
    def num_cached_tokens(self) -> int:
        return sum(request.num_cached_tokens for request in self._firsts)

    @property
    def created_cache_tokens(self) -> int | None:
        """Reported by chat responses only, as vLLM does."""
        return sum(request.num_cache_creation_tokens for request in self._firsts) if self.chat else None

    def usage(self, num_generated: int) -> tuple[int, int, int, int | None]:
        """The arguments of a usage body after ``num_generated`` output tokens in all."""
        return self.num_prompt_tokens, num_generated, self.num_cached_tokens, self.created_cache_tokens


class ClientDisconnectedError(Exception):
    """The client left before a non-streamed response was ready; its request was aborted."""


class EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine request however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class OpenAIServing:
    """The OpenAI routes of one replica: requests into engine requests, outputs into responses."""

    def __init__(
        self, model: ServedModel, driver: EngineDriver, frontend: FrontendTerms | None = None
    ) -> None:
        self.model = model
        self.driver = driver
        self.max_model_len = driver.engine.config.max_model_len
        self.frontend = frontend or FrontendTerms()

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = self.driver.now()
        self._check_request(body, body.max_tokens, "max_tokens")
        prompts = await self._completion_prompts(body.prompt)
        return await self._generate(body, prompts, body.max_tokens, raw, arrival, chat=False)

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = self.driver.now()
        if body.max_completion_tokens is not None:
            max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = body.max_tokens, "max_tokens"
        self._check_request(body, max_tokens, param)
        _check_tool_choice(body.tool_choice)
        text = self._render_chat(body.messages, body.add_generation_prompt)
        prompt_ids = await self._generation_prompt_ids(text)
        return await self._generate(body, [(prompt_ids, True)], max_tokens, raw, arrival, chat=True)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.messages is not None:
            self._check_model(body.model)
            tokens = await self._encode(self._render_chat(body.messages, body.add_generation_prompt))
        elif isinstance(body.prompt, str):
            self._check_model(body.model)
            tokens = await self._encode(body.prompt)
        else:
            # vLLM's body is a union of a prompt request and a messages request: both failed.
            received = body.model_dump(exclude_unset=True)
            prompt_error = (
                _field_error("string_type", "prompt", "Input should be a valid string", body.prompt)
                if "prompt" in received
                else _field_error("missing", "prompt", "Field required", received)
            )
            raise RequestValidationError(
                [prompt_error, _field_error("missing", "messages", "Field required", received)]
            )
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    # ------------------------------------------------------------ checks

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model.name:  # no name, or an empty one: the served model
            raise model_not_found(model, self.model.name)

    def _check_request(self, body: GenerationRequest, max_tokens: int | None, param: str) -> None:
        """Checks that need no tokenization, in vLLM's order."""
        self._check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", parameter="stream_options"
            )
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise bad_request(
                f"{param}={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.",
                parameter=param,
                value=max_tokens,
            )

    async def _completion_prompts(self, prompt: Any) -> list[tuple[list[int], bool]]:
        """Token ids of each prompt of a completion, and whether they came from text.

        An empty prompt in a batch (``[""]``, ``[[]]``) passes here, as in vLLM, and is refused
        after the output-length check (``_engine_request``).
        """
        if prompt is None or prompt == "":
            raise bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt"
            )
        if prompt == []:
            raise ApiError(400, "BadRequestError", "You must pass at least one prompt")
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        return [
            (await self._generation_prompt_ids(item), True) if isinstance(item, str) else (item, False)
            for item in batch
        ]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.model.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, "BadRequestError", str(exc)) from None

    async def _generation_prompt_ids(self, text: str) -> list[int]:
        """Tokenize the text of a prompt to generate from. Like vLLM, refuse first, untokenized, a
        text longer than ``max_model_len`` of the vocabulary's longest tokens."""
        max_chars = self.max_model_len * self.model.tokenizer.max_chars_per_token
        if len(text) > max_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt contains {len(text)} characters (more than {max_chars} characters, which is "
                f"the upper bound for {self.max_model_len} input tokens). Please reduce the length of "
                "the input prompt.",
                parameter="input_text",
                value=len(text),
            )
        return await self._encode(text)

    async def _encode(self, text: str) -> list[int]:
        # The tokenizer releases the GIL on long texts: tokenizing them in a worker thread keeps
        # one big prompt from stalling the engine loops of every replica in this process.
        if len(text) > GIL_FREE_CHARS:
            return await asyncio.to_thread(self.model.tokenizer.encode, text)
        return self.model.tokenizer.encode(text)

    async def _generate(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[tuple[list[int], bool]],
        max_tokens: int | None,
        raw: Request,
        arrival: float,
        *,
        chat: bool,
    ) -> Response:
        n = body.n or 1
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(8).hex()}"
        request_ids = (
            [response_id]
            if len(prompts) * n == 1
            else [f"{response_id}-{index}" for index in range(len(prompts) * n)]
        )
        choices = [prompt for prompt in prompts for _ in range(n)]
        generation = _Generation(
            response_id=response_id,
            requests=[
                self._engine_request(body, ids, from_text, max_tokens, raw, arrival, request_id=request_id)
                for (ids, from_text), request_id in zip(choices, request_ids, strict=True)
            ],
            n=n,
            chat=chat,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            created=int(time.time()),
        )
        # The modelled front end (vLLM's input and output processing) delays the request without
        # occupying the engine, which keeps stepping the requests it has meanwhile.
        delay = self.frontend.delay(generation.num_prompt_tokens, self.driver.engine.num_running)
        if delay > 0:
            await asyncio.sleep(delay)
        streams = self._submit(generation.requests)
        if body.stream:
            return EngineStreamResponse(
                self._events(generation, streams), on_close=lambda: self._abort(generation.requests)
            )
        outputs = await self._collect(generation.requests, streams, raw)
        usage_body = usage(*generation.usage(sum(len(output_ids) for output_ids, _ in outputs)))
        finished = [(self.model.text(output_ids), finish_reason) for output_ids, finish_reason in outputs]
        build = chat_response if chat else completion_response
        return JSONResponse(build(response_id, generation.created, self.model.name, finished, usage_body))

    def _engine_request(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        from_text: bool,
        max_tokens: int | None,
        raw: Request,
        arrival: float,
        *,
        request_id: str,
    ) -> EngineRequest:
        """Check the prompt and output lengths and the token ids (vLLM's wording and order) and build
        the engine request."""
        limit = self.max_model_len
        num_prompt = len(prompt_ids)
        if num_prompt > limit:
            # vLLM tokenizes text with truncation at limit + 1, so a text is "at least" that long; it
            # says so for any prompt of exactly limit + 1 tokens, having no way to tell them apart.
            shown = min(num_prompt, limit + 1) if from_text else num_prompt
            qualifier = "at least " if shown == limit + 1 else ""
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{qualifier}{shown} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt.",
                parameter="input_tokens",
                value=shown,
            )
        output_tokens = limit - num_prompt if max_tokens is None else min(limit - num_prompt, max_tokens)
        check_sampling(body, output_tokens)
        check_logprob_limits(body, self.model.tokenizer.vocab_size)
        if not prompt_ids:
            raise ApiError(400, "BadRequestError", "The decoder prompt cannot be empty")
        if not from_text and max(prompt_ids) >= self.model.tokenizer.vocab_size:
            # Negative ids never get here: the request schema refuses them, as vLLM's does.
            raise ApiError(400, "BadRequestError", f"Token id {max(prompt_ids)} is out of vocabulary")
        return EngineRequest(
            request_id,
            prompt_ids,
            output_tokens,
            cache_salt=body.cache_salt,
            seed=body.seed,
            arrival_time=arrival,
            stop_after_tokens=None if body.ignore_eos else self._stop_after(raw),
        )

    def _stop_after(self, raw: Request) -> int | None:
        value = raw.headers.get(SIM_OUTPUT_TOKENS_HEADER)
        if value is None:
            return None
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            raise bad_request(
                f"{SIM_OUTPUT_TOKENS_HEADER} must be a positive integer",
                parameter=SIM_OUTPUT_TOKENS_HEADER,
                value=value,
            )
        return count

    def _submit(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Submit every choice's request, or none (those submitted are aborted)."""
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(self.driver.submit(request))
        except RequestRejectedError as exc:
            self._abort(requests[: len(streams)])
            raise bad_request(str(exc)) from None
        except EngineDeadError as exc:
            raise ApiError(500, "InternalServerError", str(exc)) from None
        return streams

    def _abort(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self.driver.abort(request.request_id)

    # ------------------------------------------------------------ responses

    async def _collect(
        self, requests: list[EngineRequest], streams: list[RequestStream], raw: Request
    ) -> list[tuple[list[int], str]]:
        """Wait for every choice's whole output; abort the engine requests if the client goes away
        first."""
        collect = asyncio.ensure_future(asyncio.gather(*map(_gather_output, streams)))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
        try:
            done, _ = await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:
                raise ClientDisconnectedError
            return collect.result()
        except EngineDeadError as exc:
            raise ApiError(500, "InternalServerError", str(exc)) from None
        finally:
            collect.cancel()
            disconnect.cancel()
            self._abort(requests)

    async def _events(self, generation: _Generation, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The SSE frames of a streamed response: one chunk per token of any choice, usage if asked,
        [DONE]."""
        response_id, created, name = generation.response_id, generation.created, self.model.name
        chunk = chat_content_chunk if generation.chat else completion_chunk
        started: set[int] = set()
        num_generated = 0
        try:
            async for index, output in _choice_outputs(streams):
                if generation.chat and index not in started:
                    # vLLM announces a choice's role with its first token, not before.
                    started.add(index)
                    yield sse(chat_role_chunk(response_id, created, name, index))
                num_generated += len(output.new_token_ids)
                yield sse(
                    chunk(
                        response_id,
                        created,
                        name,
                        index,
                        self.model.text(output.new_token_ids),
                        output.finish_reason,
                        fingerprint=output.finish_reason is not None and not generation.include_usage,
                    )
                )
        except EngineDeadError as exc:
            yield _stream_error(exc)
        else:
            if generation.include_usage:
                object_name = "chat.completion.chunk" if generation.chat else "text_completion"
                yield sse(
                    stream_usage_chunk(
                        response_id, object_name, created, name, *generation.usage(num_generated)
                    )
                )
        yield SSE_DONE


async def _choice_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Each choice's outputs as they come, with the choice's index; the first engine error ends
    them all."""
    if len(streams) == 1:  # the common case, without a task per stream
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except EngineDeadError as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    pumps = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()


def _check_tool_choice(choice: str | dict[str, Any] | None) -> None:
    """The simulated model, like vLLM without a tool-call parser, cannot choose a tool."""
    if choice is None or choice == "none":
        return
    if choice == "auto":
        raise ApiError(
            400,
            "BadRequestError",
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        )
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    described = f'function "{name}"' if name is not None else f'"{choice}"'
    raise ApiError(400, "BadRequestError", f"tool_choice={described} requires --tool-call-parser to be set")


def _field_error(kind: str, field: str, message: str, value: Any) -> dict[str, Any]:
    """A request-body validation error as pydantic words it."""
    return {"type": kind, "loc": ("body", field), "msg": message, "input": value}


async def _gather_output(stream: RequestStream) -> tuple[list[int], str]:
    token_ids: list[int] = []
    finish_reason = "abort"
    async for output in stream:
        token_ids += output.new_token_ids
        finish_reason = output.finish_reason or finish_reason
    return token_ids, finish_reason


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stream_error(exc: Exception) -> str:
    return sse({"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}})
