"""The plugin interfaces of the scheduling core.

A request is scheduled in this order (see ``epp.scheduling.pipeline``):
data producers (ordered by what they produce and consume; they may await, e.g. a remote
predictor) → admitters → filters → scorers (weighted sum of [0, 1] scores) → picker →
pre-request hooks. With a candidate sampler, the producers it reads from run first, over every
endpoint; everything after it sees only its sample. Response observers then follow the
request's lifecycle, as the request lifecycle (``epp.requestcontrol.lifecycle``) reports it.

Plugins are plain classes registered by kebab-case type name. They receive everything they
need through arguments and a :class:`PluginContext` (injected clock and RNG), never by
reaching for I/O or globals, so the live server, the fleet simulator and the tests run the
same code.
"""

from __future__ import annotations

import itertools
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from epp.scheduling.predictor import LatencyPredictor
from epp.scheduling.types import Endpoint, EndpointState, LLMRequest, SchedulingResult

T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)
class DataKey(Generic[T]):
    """Names one kind of per-request data a producer writes and plugins read.

    Each key is one module-level object and compares by identity: the cycle state is read dozens
    of times per request, and identity hashing is native where a dataclass's is Python code."""

    name: str


class CycleState:
    """Per-request scratch space: data produced for this request, keyed by :class:`DataKey`.

    ``key`` is unique among this process's requests, unlike the client's request id (a retry may
    reuse one while the first attempt is still closing): plugins that keep per-request state
    across requests key it by ``key``."""

    __slots__ = ("_data", "key")
    _keys = itertools.count()

    def __init__(self) -> None:
        self._data: dict[DataKey[Any], Any] = {}
        self.key: int = next(CycleState._keys)

    def put(self, key: DataKey[T], value: T) -> None:
        self._data[key] = value

    def get(self, key: DataKey[T]) -> T | None:
        return self._data.get(key)

    def __contains__(self, key: DataKey[Any]) -> bool:
        return key in self._data


@runtime_checkable
class RunsAmongReplicas(Protocol):
    """A plugin that decides differently while this EPP syncs with live peer replicas, which see
    each other's picks a sync lag late. ``epp.sync.hook`` calls :meth:`join_replicas` on every
    such plugin in the pipeline."""

    def join_replicas(self, live_peers: Callable[[], int]) -> None:
        """``live_peers()`` counts the peers heard from within their timeout, now."""
        ...


@runtime_checkable
class ReadsEngineTokenIds(Protocol):
    """A plugin that matches the prompt's ids against the engines' own (their KV events): it
    needs the served model's tokenizer on every prompt, not estimated ids."""

    def engine_token_ids_needed(self) -> str:
        """Why, in a few words (for the EPP's refusal to start without them)."""
        ...


class KVBlockIndex(Protocol):
    """What the engines report holding, block by block (their KV events), as plugins read it."""

    def longest_prefix(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each endpoint holds (endpoints holding none left out)."""
        ...

    def is_live(self, endpoint: str) -> bool:
        """Whether ``endpoint``'s events are followed and current (else consumers fall back)."""
        ...


@dataclass(slots=True)
class PluginContext:
    """What the framework hands every plugin: the clock and the random source to use, and the
    services some plugins need (None when the process runs without them)."""

    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)
    wall_clock: Callable[[], float] = time.time
    """Seconds since the epoch, for timestamps that leave the process (training samples)."""
    latency_predictor: LatencyPredictor | None = None
    kv_index: KVBlockIndex | None = None
    """The engines' KV blocks from their KV events (the live EPP's is fed by its data layer);
    without one, precise consumers fall back as for an endpoint without KV events."""


class NoParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginParameters(BaseModel):
    """Base for plugin parameter tables: camelCase keys as in EndpointPickerConfig, strict."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Plugin:
    """Base of every plugin. Subclasses set ``type_name`` and, if configurable, ``Parameters``."""

    type_name: ClassVar[str]
    Parameters: ClassVar[type[BaseModel]] = NoParameters
    produces: ClassVar[tuple[DataKey[Any], ...]] = ()
    consumes: ClassVar[tuple[DataKey[Any], ...]] = ()
    reads_if_present: ClassVar[tuple[DataKey[Any], ...]] = ()
    """Data a producer uses when the config produces it (it runs after that data's producer),
    without asking for a default producer of it as ``consumes`` does."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        self.name = name
        self.params = params
        self.context = context

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class DataProducer(Plugin, ABC):
    """Computes data for a request before it is scheduled (prefix matches, predictions, ...).

    ``produce`` may return an awaitable (a remote call); the pipeline awaits it. A producer
    that fails writes nothing, and the plugins that read its data fall back.
    """

    @abstractmethod
    def produce(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> Awaitable[None] | None: ...


class CandidateSampler(Plugin, ABC):
    """Narrows a large pool to the endpoints one cycle examines, so that the per-endpoint work
    after it (token loads, feature rows, predictions, filters, scorers) does not grow with the
    pool. Runs after the producers of the data it reads and before every other producer."""

    @abstractmethod
    def sample(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> Sequence[EndpointState]:
        """A subset of ``endpoints``, in their order (all of them when the pool is small)."""


class Admitter(Plugin, ABC):
    """Decides whether a request is served at all; refuses by raising a ``RequestError``."""

    @abstractmethod
    def admit(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None: ...


class Filter(Plugin, ABC):
    """Narrows the candidate endpoints. Returns a subset, in the given order."""

    @abstractmethod
    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]: ...


class Scorer(Plugin, ABC):
    """Scores each candidate in [0, 1]; higher is better. The profile weighs and sums scores."""

    @abstractmethod
    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> Sequence[float]: ...


@dataclass(slots=True)
class ScoredEndpoint:
    state: EndpointState
    score: float


class Picker(Plugin, ABC):
    """Orders the scored candidates; the first is the target, the rest are fallbacks."""

    @abstractmethod
    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[EndpointState]: ...


class PreRequest(Plugin, ABC):
    """Runs once the target is chosen, before the request is forwarded."""

    @abstractmethod
    def pre_request(self, request: LLMRequest, result: SchedulingResult, state: CycleState) -> None: ...


@dataclass(slots=True)
class RequestOutcome:
    """How a routed request ended, as seen by the EPP (times from the injected clock)."""

    endpoint: Endpoint
    received_at: float
    finished_at: float
    status: int | None
    streaming: bool
    completed: bool
    """The response ended normally with a status below 400."""
    first_token_at: float | None
    completion_tokens: int | None
    """Output tokens, when the response body was watched (streaming responses)."""

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.received_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.received_at

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, counted in tokens."""
        if self.first_token_at is None or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.completion_tokens - 1)


def slo_misses(request: LLMRequest, outcome: RequestOutcome) -> tuple[bool, bool]:
    """Whether a request missed its TTFT and its TPOT objective (False where it set none, or
    where that latency was not measured). A non-streaming client sees its first token when the
    whole response arrives; its TPOT is not measured. The one SLO rule of the EPP: its
    violation counters and the live page both use it."""
    first_token_s = outcome.ttft_s if outcome.streaming else outcome.e2e_s
    ttft = (
        request.slo_ttft_ms is not None
        and first_token_s is not None
        and first_token_s * 1e3 > request.slo_ttft_ms
    )
    tpot_s = outcome.tpot_s if outcome.streaming else None
    tpot = request.slo_tpot_ms is not None and tpot_s is not None and tpot_s * 1e3 > request.slo_tpot_ms
    return ttft, tpot
