"""Plain data the scheduling core works on: endpoints, their engine metrics, requests, results.

Everything here is a value or a small mutable record. Nothing does I/O or reads a clock;
timestamps are whatever the injected clock said when the data was recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server replica (a vLLM pod, or one data-parallel rank of it)."""

    name: str
    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    kv_events_endpoint: str | None = None
    """ZMQ endpoint of the engine's KV-event publisher (``tcp://ip:port`` or ``ipc://path``)."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint that replays missed KV-event batches, if the engine has one."""

    @property
    def hostport(self) -> str:
        """``ip:port`` as Envoy's original-destination cluster expects it (IPv6 bracketed)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@dataclass(slots=True)
class EngineMetrics:
    """The engine's own view of its load, as last scraped from its ``/metrics``."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    updated_at: float = -math.inf

    def age(self, now: float) -> float:
        return now - self.updated_at


@dataclass(slots=True)
class EndpointState:
    """What a scheduling cycle may know about one endpoint: identity, scraped metrics, and
    the EPP's own count of requests it has routed there that have not finished."""

    endpoint: Endpoint
    metrics: EngineMetrics
    in_flight: int = 0
    max_model_len: int | None = None
    """The engine's context length in tokens, from its ``/v1/models``; None until it answers."""

    @property
    def name(self) -> str:
        return self.endpoint.name


class ApiKind(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    OTHER = "other"


@dataclass(slots=True)
class LLMRequest:
    """A parsed inference request, as the scheduling core sees it."""

    request_id: str
    model: str
    api: ApiKind
    prompt_token_ids: list[int]
    stream: bool = False
    max_tokens: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    cache_salt: str | None = None
    body: dict[str, Any] = field(default_factory=dict, repr=False)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    priority: int = 0
    """Below zero: sheddable when no endpoint can meet the request's SLO."""
    prediction_based: bool | None = None
    """Per-request opt in/out of predicted-latency scheduling; None means the configured default."""
    debug: bool = False
    """Report the routing decision in response headers."""
    expected_output_tokens: int | None = None
    """The client's estimate of the answer's length (``x-expected-output-tokens``); None: none given."""

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The picked endpoint first, then ranked fallbacks (possibly none)."""

    targets: tuple[Endpoint, ...]
    profile: str
    scores: Mapping[str, float] = field(default_factory=dict)

    @property
    def endpoint(self) -> Endpoint:
        return self.targets[0]
