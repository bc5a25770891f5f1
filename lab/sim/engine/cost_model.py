"""How long one engine step takes, and how long the server's front end holds a request.

A step runs the batch the scheduler picked: prefill tokens (new prompt tokens, possibly a chunk)
and decode sequences (one token each). Its duration is a shared base plus two polynomials::

    step_ms    = base + prefill_ms + decode_ms                         for a step that does work
    prefill_ms = p.base + p.per_token·T + p.per_token_sq·T²
               + p.per_context_token·A                                 if T > 0 prefill tokens
    decode_ms  = max(d.min, d.base + d.per_seq·n + d.per_context_token·C
                            + d.kv_fraction·u + d.kv_fraction_sq·u²)   if n > 0 decode sequences

``T`` is the step's prefill tokens, ``A`` its prefill attention work: every new prompt token
attends to the tokens before it and itself, so a chunk of ``t`` tokens after ``c`` computed ones
adds ``t·c + t(t+1)/2`` (for one uncached prompt of ``T`` tokens, about ``T²/2``; unlike ``T²``
this does not grow with the square of a batch of short prompts). ``C`` is the total context
length of the decode sequences (the same attention work: each decode token attends to its
context), ``u`` the fraction of the KV cache in use. The shared ``base`` is the fixed cost of any
step (scheduling, input preparation, sampling); a step that mixes prefill and decode pays it once.
With only ``p.base``, ``p.per_token``, ``p.per_token_sq``, ``d.base``, ``d.kv_fraction``,
``d.kv_fraction_sq`` and ``d.min`` this is NVIDIA Dynamo mocker's default model (see
``profiles/default.yaml``).

Each new request also takes engine time outside the steps (``IntakeTerms``): vLLM's engine core
deserialises it, hashes its prompt's blocks and adds it to the scheduler in the same process,
between and beside the steps, so the step after its arrival ends that much later. Its cost grows
with the rate of arrivals, which the step probes (one request at a time) never show.

The front end (HTTP, tokenization and input processing before the engine; detokenization and
streaming after it) runs beside the engine, not in its steps: ``FrontendTerms`` is the latency
it adds to each request, which the server spends before handing the request to the engine. It
grows with the prompt and with the requests already running, whose tokens the front end streams.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True, slots=True)
class PrefillTerms:
    """Coefficients of the prefill polynomial, in milliseconds."""

    base: float = 0.0
    per_token: float = 0.0
    per_token_sq: float = 0.0
    per_context_token: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeTerms:
    """Coefficients of the decode polynomial, in milliseconds; ``min`` floors the result."""

    base: float = 0.0
    per_seq: float = 0.0
    per_context_token: float = 0.0
    kv_fraction: float = 0.0
    kv_fraction_sq: float = 0.0
    min: float = 0.0


@dataclass(frozen=True, slots=True)
class FrontendTerms:
    """Latency the server's front end adds to a request, in milliseconds: ``base +
    per_prompt_token·P + per_running_request·R`` for a prompt of ``P`` tokens arriving while ``R``
    requests run in the engine (the front end streams their tokens too, and the new request waits
    its turn)."""

    base: float = 0.0
    per_prompt_token: float = 0.0
    per_running_request: float = 0.0

    def delay(self, num_prompt_tokens: int, num_running: int) -> float:
        """Seconds between a request's arrival and its entering the engine (never negative)."""
        ms = self.base + self.per_prompt_token * num_prompt_tokens + self.per_running_request * num_running
        return max(0.0, ms) / 1000.0


@dataclass(frozen=True, slots=True)
class IntakeTerms:
    """Engine time a new request takes outside the steps, in milliseconds: ``base +
    per_prompt_token·P`` for a prompt of ``P`` tokens."""

    base: float = 0.0
    per_prompt_token: float = 0.0

    def time(self, num_prompt_tokens: int) -> float:
        """Seconds of engine time taking in a request of this prompt length."""
        return (self.base + self.per_prompt_token * num_prompt_tokens) / 1000.0


@dataclass(frozen=True, slots=True)
class StepCostModel:
    prefill: PrefillTerms
    decode: DecodeTerms
    base: float = 0.0
    """Milliseconds every step that does work pays once."""
    intake: IntakeTerms = IntakeTerms()
    """Engine time each new request adds to the step after its arrival."""

    def step_time(
        self,
        num_prefill_tokens: int,
        prefill_context_tokens: int,
        num_decode_seqs: int,
        decode_context_tokens: int,
        kv_usage: float,
    ) -> float:
        """Duration in seconds of a step with this batch; 0 for an empty step.

        ``prefill_context_tokens`` is the prefill attention work ``A`` and
        ``decode_context_tokens`` the decode context ``C`` of the module docstring.
        """
        if num_prefill_tokens <= 0 and num_decode_seqs <= 0:
            return 0.0
        ms = self.base
        if num_prefill_tokens > 0:
            p = self.prefill
            t = num_prefill_tokens
            ms += p.base + p.per_token * t + p.per_token_sq * t * t
            ms += p.per_context_token * prefill_context_tokens
        if num_decode_seqs > 0:
            d = self.decode
            u = kv_usage
            decode_ms = (
                d.base
                + d.per_seq * num_decode_seqs
                + d.per_context_token * decode_context_tokens
                + d.kv_fraction * u
                + d.kv_fraction_sq * u * u
            )
            ms += max(d.min, decode_ms)
        return ms / 1000.0

    def scaled(self, factor: float) -> StepCostModel:
        """The same model with every step ``factor`` times as long (an engine that slowed down)."""
        return StepCostModel(
            PrefillTerms(*(value * factor for value in astuple(self.prefill))),
            DecodeTerms(*(value * factor for value in astuple(self.decode))),
            self.base * factor,
            IntakeTerms(*(value * factor for value in astuple(self.intake))),
        )


def chunk_context_tokens(num_new_tokens: int, num_computed_tokens: int) -> int:
    """Attention work of computing ``num_new_tokens`` prompt tokens after ``num_computed_tokens``:
    each new token attends to every token before it and to itself."""
    return num_new_tokens * num_computed_tokens + num_new_tokens * (num_new_tokens + 1) // 2
