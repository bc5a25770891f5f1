"""The last routing decisions and their outcomes, for the live ``/dashboard`` page.

:class:`RecentDecisions` is a lifecycle observer (``epp.scheduling.observers``): the request
lifecycle calls ``on_finished`` once per routed request, and it keeps a bounded ring of
:class:`Decision` records plus running totals. It only appends (no I/O); the page's HTTP thread
reads it with :meth:`snapshot`. A decision's trace is built there, when first read, from what
the request left (``TraceSource``): most decisions are never looked at, and building a trace
costs more than the rest of the record.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

from epp.observability.decision import DECISION_TRACE, TraceSource
from epp.scheduling.framework import RequestOutcome, slo_misses
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.predictions import LATENCY_PREDICTIONS, PREDICTION_FALLBACK
from epp.scheduling.types import LLMRequest

CAPACITY = 500


@dataclass(frozen=True, slots=True)
class Decision:
    """One routed request: where it went, what was predicted there, what happened.

    Latencies are in ms, None where not measured (a non-streaming response has no TTFT) or not
    predicted. ``slo_met`` is None for a request without an SLO. ``trace`` is the request's
    decision trace (``epp.observability.decision``).
    """

    finished_at: float
    request_id: str
    model: str
    endpoint: str
    profile: str
    status: int | None
    completed: bool
    predicted_ttft_ms: float | None
    predicted_tpot_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_met: bool | None
    fallback: str | None
    trace: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts since the EPP started."""

    finished: int
    slo_checked: int
    slo_met: int
    fallbacks: dict[str, int]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _slo_met(request: LLMRequest, outcome: RequestOutcome) -> bool | None:
    """None without an SLO; an unfinished or failed request missed it."""
    if request.slo_ttft_ms is None and request.slo_tpot_ms is None:
        return None
    return outcome.completed and not any(slo_misses(request, outcome))


class _LazyTrace:
    """A decision trace built on first read (the page's thread) and kept; or one already built."""

    __slots__ = ("_source", "_trace")

    def __init__(self, source: TraceSource | None, trace: dict[str, Any] | None) -> None:
        self._source, self._trace = source, trace

    def get(self) -> dict[str, Any]:
        if self._trace is None:
            assert self._source is not None
            self._trace, self._source = self._source.build(), None
        return self._trace


class RecentDecisions(LifecycleObserver):
    """Keeps the last ``capacity`` decisions and counts every finished request."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._decisions: deque[tuple[Decision, _LazyTrace]] = deque(maxlen=capacity)
        self._finished = 0
        self._slo_checked = 0
        self._slo_met = 0
        self._fallbacks: Counter[str] = Counter()

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        request, result, state = routed.request, routed.result, routed.state
        predictions = state.get(LATENCY_PREDICTIONS)
        predicted = predictions.by_endpoint.get(outcome.endpoint.name) if predictions else None
        fallback = state.get(PREDICTION_FALLBACK)
        met = _slo_met(request, outcome)
        self._finished += 1
        if met is not None:
            self._slo_checked += 1
            self._slo_met += met
        if fallback is not None:
            self._fallbacks[fallback] += 1
        built = state.get(DECISION_TRACE)  # a debug header or a span asked for it already
        trace = _LazyTrace(None, built) if built is not None else _LazyTrace(TraceSource.of(routed), None)
        decision = Decision(
            finished_at=outcome.finished_at,
            request_id=request.request_id,
            model=request.model,
            endpoint=outcome.endpoint.name,
            profile=result.profile,
            status=outcome.status,
            completed=outcome.completed,
            predicted_ttft_ms=predicted.ttft_ms if predicted else None,
            predicted_tpot_ms=predicted.tpot_ms if predicted else None,
            ttft_ms=_ms(outcome.ttft_s) if outcome.streaming else None,
            tpot_ms=_ms(outcome.tpot_s),
            slo_ttft_ms=request.slo_ttft_ms,
            slo_tpot_ms=request.slo_tpot_ms,
            slo_met=met,
            fallback=fallback,
        )
        self._decisions.append((decision, trace))

    def snapshot(self) -> tuple[tuple[Decision, ...], Totals]:
        """The decisions held, oldest first, with their traces, and the totals. Safe from another
        thread: copying a deque holds the GIL throughout, and a trace's inputs no longer change."""
        decisions = tuple(replace(decision, trace=trace.get()) for decision, trace in tuple(self._decisions))
        return decisions, Totals(self._finished, self._slo_checked, self._slo_met, dict(self._fallbacks))
