"""The plugin interfaces of the scheduling core.

A request is scheduled in this order (see ``epp.requestcontrol.director``):
data producers (ordered by what they produce and consume) → admitters → filters → scorers
(weighted sum of [0, 1] scores) → picker → pre-request hooks. Response observers then
follow the request's lifecycle.

Plugins are plain classes registered by kebab-case type name. They receive everything they
need through arguments and a :class:`PluginContext` (injected clock and RNG), never by
reaching for I/O or globals, so the live server, the fleet simulator and the tests run the
same code.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DataKey(Generic[T]):
    """Names one kind of per-request data a producer writes and plugins read."""

    name: str


class CycleState:
    """Per-request scratch space: data produced for this request, keyed by :class:`DataKey`."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[DataKey[Any], Any] = {}

    def put(self, key: DataKey[T], value: T) -> None:
        self._data[key] = value

    def get(self, key: DataKey[T]) -> T | None:
        return self._data.get(key)

    def __contains__(self, key: DataKey[Any]) -> bool:
        return key in self._data


@dataclass(slots=True)
class PluginContext:
    """What the framework hands every plugin: the clock and the random source to use."""

    clock: Callable[[], float]
    rng: random.Random = field(default_factory=random.Random)


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

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        self.name = name
        self.params = params
        self.context = context

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class DataProducer(Plugin, ABC):
    """Computes data for a request before it is scheduled (prefix matches, predictions, ...)."""

    @abstractmethod
    def produce(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None: ...


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
