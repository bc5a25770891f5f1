"""vLLM 0.32's refusals of sampling parameters, in its words and order.

vLLM checks them in three places, and so does the simulator: while parsing the body (the logprob
fields' types and signs: the request models' before-validators in ``sim.openai_api``); when it
builds a request's ``SamplingParams`` (``check_sampling``: the ranges below, in vLLM's order); and
when the engine admits the request (``check_logprob_limits``).

Unset fields take vLLM's neutral defaults (temperature 1, top_p 1, no penalties), which pass.
"""

from __future__ import annotations

import math

from sim.openai_api import ApiError, ChatCompletionRequest, CompletionRequest, bad_request

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``: the most logprobs a request may ask for per token."""


def _refused(message: str) -> ApiError:
    """A refusal that vLLM words without naming the parameter."""
    return ApiError(400, "BadRequestError", message)


def _check_logit_bias(logit_bias: dict[str, float]) -> None:
    invalid = [key for key in logit_bias if not _is_int_text(key)]
    if invalid:
        raise bad_request(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
            parameter="logit_bias",
            value=invalid,
        )


def _is_int_text(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def check_sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> None:
    """vLLM's ``SamplingParams`` checks, ``max_tokens`` being the output length actually left."""
    _check_logit_bias(body.logit_bias or {})
    if body.n is not None and body.n < 1:
        raise _refused(f"n must be at least 1, got {body.n}.")
    presence = 0.0 if body.presence_penalty is None else body.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise _refused(f"presence_penalty must be in [-2, 2], got {presence}.")
    frequency = 0.0 if body.frequency_penalty is None else body.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise _refused(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    if not math.isfinite(repetition):
        raise _refused(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise _refused(f"repetition_penalty must be greater than zero, got {repetition}.")
    _check_temperature(1.0 if body.temperature is None else body.temperature)
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p)
    top_k = 0 if body.top_k is None else body.top_k
    if top_k < -1:
        raise _refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if body.min_p is None else body.min_p
    if not 0.0 <= min_p <= 1.0:
        raise _refused(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise bad_request(
            f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens", value=max_tokens
        )
    if body.min_tokens < 0:
        raise _refused(f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.")
    if body.min_tokens > max_tokens:
        raise _refused(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}."
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if not all(stop):
        raise _refused("stop cannot contain an empty string.")


def _check_temperature(temperature: float) -> None:
    def refused(message: str) -> ApiError:
        return bad_request(message, parameter="temperature", value=temperature)

    if not math.isfinite(temperature):
        raise refused(f"temperature must be a finite number, got {temperature}.")
    if temperature < 0.0:
        raise refused(f"temperature must be non-negative, got {temperature}.")
    if temperature > 2.0:
        raise refused(f"temperature must be in [0, 2], got {temperature}.")


def check_logprob_limits(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """At most ``MAX_LOGPROBS`` per token, -1 ("all") counting as the whole vocabulary."""
    for parameter, label, requested in (
        ("logprobs", "sample", body.sample_logprobs()),
        ("prompt_logprobs", "prompt", body.prompt_logprobs),
    ):
        if not requested:
            continue
        count = vocab_size if requested == -1 else requested
        if count > MAX_LOGPROBS:
            raise bad_request(
                f"Requested {label} logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
                parameter=parameter,
                value=count,
            )
