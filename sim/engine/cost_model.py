"""How long one engine step takes, as a function of what the step computes.

A step runs the batch the scheduler picked: prefill tokens (new prompt tokens, possibly a chunk)
and decode sequences (one token each). Its duration is the sum of two polynomials::

    prefill_ms = base + per_token·T + per_token_sq·T²                 if T > 0 prefill tokens
    decode_ms  = max(min, base + per_seq·n + per_context_token·C
                          + kv_fraction·u + kv_fraction_sq·u²)      if n > 0 decode sequences

where ``C`` is the total context length of the decode sequences and ``u`` the fraction of the KV
cache in use. With ``per_seq = per_context_token = 0`` this is NVIDIA Dynamo mocker's default
model (see ``profiles/default.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillTerms:
    """Coefficients of the prefill polynomial, in milliseconds."""

    base: float = 0.0
    per_token: float = 0.0
    per_token_sq: float = 0.0


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
class StepCostModel:
    prefill: PrefillTerms
    decode: DecodeTerms

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        decode_context_tokens: int,
        kv_usage: float,
    ) -> float:
        """Duration in seconds of a step with this batch; 0 for an empty step."""
        ms = 0.0
        if num_prefill_tokens > 0:
            p = self.prefill
            t = num_prefill_tokens
            ms += p.base + p.per_token * t + p.per_token_sq * t * t
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
