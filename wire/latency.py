"""The latency model's wire schema: feature rows and training samples, as the EPP sends them.

Field names follow the public llm-d latency predictor, so its clients and dashboards work
against ours. A *feature row* describes one request on one endpoint at the moment it was
scheduled (``POST /predict/bulk/strict``, ``{"requests": [row, ...]}``); a *training sample*
adds what actually happened (``POST /add_training_data_bulk``, ``{"entries": [sample, ...]}``).

Each has two forms, declared here side by side and checked equal by the tests: the pydantic
model, whose field constraints the servers validate against (``trainer.features``), and the
``TypedDict`` the EPP builds on its hot path (a plain dict: building a model costs
microseconds per row, and the EPP builds one per candidate endpoint of every request).

Types are strict (JSON integers for integer fields, numbers for float fields, one of the
``PodType`` strings for ``pod_type``): a row that needs coercion is a wrong row.

``endpoint_class`` is ours, not llm-d's (its clients leave it out and get 0): which kind of
endpoint the row is about (an accelerator type, a serving config), as the code
:func:`endpoint_class_code` gives the value of a pod label the operator names. The model learns
each class's speed from its samples, and the trainer keeps every class's samples apart.
"""

from __future__ import annotations

import functools
import typing
from typing import Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field
from xxhash import xxh3_64_intdigest

PodType = Literal["", "prefill", "decode"]
POD_TYPES: tuple[str, ...] = typing.get_args(PodType)
MAX_TOKENS_FEATURE = 10_000_000
MAX_LATENCY_MS = 3_600_000.0
MAX_ENDPOINT_CLASS = (1 << 24) - 1
"""Codes stay below 2**24, where float32 (the model's input) holds every integer exactly."""


@functools.lru_cache(maxsize=4096)  # asked per candidate endpoint of every request; few values
def endpoint_class_code(value: str) -> int:
    """The ``endpoint_class`` of an endpoint whose class label has ``value``: 0 for "" (no label,
    unknown), else a stable code in 1..MAX_ENDPOINT_CLASS (the same in every process and release,
    so that EPP replicas, the trainer's window and a model agree without a shared table)."""
    if not value:
        return 0
    return xxh3_64_intdigest(value.encode()) % MAX_ENDPOINT_CLASS + 1


class FeatureRow(BaseModel):
    """One (request, endpoint) pair as the scheduler saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kv_cache_percentage: float = Field(
        ge=0.0, le=1.0, allow_inf_nan=False, description="engine KV-cache usage, a fraction"
    )
    input_token_length: int = Field(ge=0, le=MAX_TOKENS_FEATURE, description="prompt tokens")
    num_request_waiting: int = Field(ge=0, le=1_000_000, description="engine queue length")
    num_request_running: int = Field(ge=0, le=1_000_000, description="requests in the engine's batch")
    num_tokens_generated: int = Field(
        default=0, ge=0, le=MAX_TOKENS_FEATURE, description="output tokens so far (0 when scheduling)"
    )
    prefix_cache_score: float = Field(
        default=0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="fraction of prompt cached"
    )
    pod_type: PodType = Field(default="", description="role in prefill/decode disaggregation")
    prefill_tokens_in_flight: int = Field(
        default=0, ge=0, le=MAX_TOKENS_FEATURE, description="uncached prompt tokens routed, not yet prefilled"
    )
    decode_tokens_in_flight: int = Field(
        default=0, ge=0, le=MAX_TOKENS_FEATURE, description="KV tokens of requests decoding"
    )
    endpoint_class: int = Field(
        default=0, ge=0, le=MAX_ENDPOINT_CLASS, description="code of its class label; 0: unknown"
    )


class TrainingSample(FeatureRow):
    """A feature row plus the latencies the request actually saw."""

    actual_ttft_ms: float = Field(
        ge=0.0, le=MAX_LATENCY_MS, allow_inf_nan=False, description="0 when not measured"
    )
    actual_tpot_ms: float = Field(
        ge=0.0, le=MAX_LATENCY_MS, allow_inf_nan=False, description="0 when not measured"
    )
    timestamp: float = Field(
        ge=0.0, allow_inf_nan=False, description="seconds since the epoch when the request finished"
    )


class FeatureRowDict(TypedDict):
    """A :class:`FeatureRow` as the EPP builds and sends it (every field present)."""

    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    num_tokens_generated: int
    prefix_cache_score: float
    pod_type: PodType
    prefill_tokens_in_flight: int
    decode_tokens_in_flight: int
    endpoint_class: int


class TrainingSampleDict(FeatureRowDict):
    """A :class:`TrainingSample` as the EPP builds and sends it."""

    actual_ttft_ms: float
    actual_tpot_ms: float
    timestamp: float
