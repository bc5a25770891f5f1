"""A scheduling profile (filters → weighted scorers → picker) and the assembled pipeline."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.scheduling.framework import (
    Admitter,
    CandidateSampler,
    CycleState,
    DataProducer,
    Filter,
    Picker,
    Plugin,
    PreRequest,
    ScoredEndpoint,
    Scorer,
)
from epp.scheduling.observers import LifecycleObserver
from epp.scheduling.trace import SCHEDULING_TRACE, SchedulingTrace, ScorerStep
from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult

log = logging.getLogger(__name__)


class NoCandidates(Exception):
    """No endpoint is left to route to (none ready, or every one filtered out)."""


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(slots=True)
class SchedulingProfile:
    name: str
    filters: list[Filter]
    scorers: list[WeightedScorer]
    picker: Picker

    def run(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> SchedulingResult:
        candidates = list(endpoints)
        trace = SchedulingTrace(tuple(c.name for c in candidates))
        state.put(SCHEDULING_TRACE, trace)
        for f in self.filters:
            kept = f.filter(request, candidates, state)
            if len(kept) < len(candidates):
                left = {id(c) for c in kept}
                trace.removed.append((f.name, tuple(c.name for c in candidates if id(c) not in left)))
            candidates = kept
            if not candidates:
                raise NoCandidates(f"filter {f.name!r} left no endpoint")
        trace.scored = tuple(c.name for c in candidates)
        totals = [0.0] * len(candidates)
        for ws in self.scorers:
            weighted = [ws.weight * s for s in ws.scorer.score(request, candidates, state)]
            trace.scorers.append(ScorerStep(ws.scorer.name, ws.weight, tuple(weighted)))
            for i, s in enumerate(weighted):
                totals[i] += s
        scored = [ScoredEndpoint(c, t) for c, t in zip(candidates, totals, strict=True)]
        ranked = self.picker.pick(request, scored)
        if not ranked:
            raise NoCandidates(f"picker {self.picker.name!r} picked nothing")
        trace.ranking = tuple(s.name for s in ranked)
        return SchedulingResult(
            targets=tuple(s.endpoint for s in ranked),
            profile=self.name,
            scores={s.state.name: s.score for s in scored},
        )


@dataclass(slots=True)
class Pipeline:
    """Everything a request goes through: producers in dependency order, then one profile.

    With a ``sampler``, the ``sampling_inputs`` producers (what it reads) run over every
    endpoint, and the ``producers``, admitters and profile over its sample."""

    plugins: dict[str, Plugin]
    producers: list[DataProducer]
    profile: SchedulingProfile
    sampler: CandidateSampler | None = None
    sampling_inputs: list[DataProducer] = field(default_factory=list)
    admitters: list[Admitter] = field(init=False)
    pre_request: list[PreRequest] = field(init=False)
    observers: list[LifecycleObserver] = field(init=False)
    """The plugins that follow routed requests (the lifecycle calls them)."""
    producer_failures: Counter[str] = field(default_factory=Counter)
    """Exceptions each producer raised (and the pipeline swallowed), by plugin name."""

    def __post_init__(self) -> None:
        self.admitters = [p for p in self.plugins.values() if isinstance(p, Admitter)]
        self.pre_request = [p for p in self.plugins.values() if isinstance(p, PreRequest)]
        self.observers = [p for p in self.plugins.values() if isinstance(p, LifecycleObserver)]

    async def schedule(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> SchedulingResult:
        """Run producers, admitters, the profile, and pre-request hooks.

        No I/O happens here beyond what producers await, and no wall clock is read. A producer
        that raises is logged and skipped (its consumers fall back); an admitter's refusal and
        an empty candidate set propagate.
        """
        if not endpoints:
            raise NoCandidates("no ready endpoint")
        pool = len(endpoints)
        if self.sampler is not None:
            await self._produce(self.sampling_inputs, request, endpoints, state)
            endpoints = self.sampler.sample(request, endpoints, state)
        await self._produce(self.producers, request, endpoints, state)
        for admitter in self.admitters:
            admitter.admit(request, endpoints, state)
        result = self.profile.run(request, endpoints, state)
        if len(endpoints) < pool:
            trace = state.get(SCHEDULING_TRACE)
            if trace is not None:
                trace.sampled_from = pool
        for hook in self.pre_request:
            hook.pre_request(request, result, state)
        return result

    async def _produce(
        self,
        producers: list[DataProducer],
        request: LLMRequest,
        endpoints: Sequence[EndpointState],
        state: CycleState,
    ) -> None:
        for producer in producers:
            try:
                pending = producer.produce(request, endpoints, state)
                if pending is not None:
                    await pending
            except Exception:
                self.producer_failures[producer.name] += 1
                log.exception("producer %s failed; its consumers fall back", producer.name)
