"""The decision trace: why a request went where it went, compact and bounded.

One JSON-able dict per routed request, built from what the scheduling cycle recorded
(``epp.scheduling.trace``) and what the predicted-latency producer wrote:

=================  =========================================================================
``profile``        the scheduling profile
``candidates``     how many endpoints the profile started with
``sampled_from``   the pool's size, when a candidate sampler narrowed it to ``candidates``
``removed``        per filter that removed any, the endpoints it removed
``scores``         per scorer, its weighted score (weight × score) per endpoint
``total``          the summed score per endpoint (what the picker saw)
``picked``         the picker's choice; ``fallbacks`` the ranked rest
``predictions``    per endpoint: predicted TTFT/TPOT and their SLO headroom (ms), with the
                   ``model_version``; while the model drifts, the predictions not routed on
``fallback``       why the request was scheduled without predictions, or null
=================  =========================================================================

Bounded: each per-endpoint map lists at most ``MAX_ENDPOINTS`` endpoints (the picked one and
the fallbacks first, then by total score), ``omitted`` counts the rest, and numbers are
rounded; if the JSON still exceeds ``MAX_BYTES``, the per-scorer scores and then the
predictions are dropped and ``truncated`` is set. The same dict is the response header
``x-llm-epp-decision`` (for ``x-llm-epp-debug: true``), the attributes of the request's span
(``epp.observability.tracing``), a debug-level log line per request (logger
``epp.decisions``) and the live page's trace. It holds endpoint, filter and scorer names and
numbers, never prompt text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epp.scheduling.framework import DataKey, RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.predictions import (
    DRIFTED_PREDICTIONS,
    LATENCY_PREDICTIONS,
    PREDICTION_FALLBACK,
    LatencyPredictions,
)
from epp.scheduling.trace import SCHEDULING_TRACE, SchedulingTrace
from epp.scheduling.types import SchedulingResult

DECISION_HEADER = "x-llm-epp-decision"
MAX_ENDPOINTS = 8
MAX_BYTES = 4096
DECISION_TRACE: DataKey[dict[str, Any]] = DataKey("decision-trace")
"""The request's decision trace, once built (it is built at most once per request)."""
log = logging.getLogger("epp.decisions")


@dataclass(frozen=True, slots=True)
class TraceSource:
    """What a request's decision trace is built from, without the request or its cycle state:
    small enough to keep for a while, so that a trace is built only when someone reads it."""

    result: SchedulingResult
    steps: SchedulingTrace | None
    predictions: LatencyPredictions | None
    """The predictions made (routed on, or not routed on while the model drifts)."""
    fallback: str | None
    endpoint: str

    @classmethod
    def of(cls, routed: RoutedRequest) -> TraceSource:
        state = routed.state
        return cls(
            routed.result,
            state.get(SCHEDULING_TRACE),
            state.get(LATENCY_PREDICTIONS) or state.get(DRIFTED_PREDICTIONS),
            state.get(PREDICTION_FALLBACK),
            routed.endpoint_name,
        )

    def build(self) -> dict[str, Any]:
        """The decision trace (see the module docstring)."""
        return _bounded(_build(self))


def decision_trace(routed: RoutedRequest) -> dict[str, Any]:
    """The decision trace of ``routed`` (see the module docstring), built once and kept."""
    state = routed.state
    cached = state.get(DECISION_TRACE)
    if cached is None:
        cached = TraceSource.of(routed).build()
        state.put(DECISION_TRACE, cached)
    return cached


def _build(source: TraceSource) -> dict[str, Any]:
    steps, result = source.steps, source.result
    total = dict(result.scores)
    ranking = list(steps.ranking) if steps is not None else [t.name for t in result.targets]
    candidates = steps.candidates if steps is not None else tuple(total)
    listed = _listed(ranking, total, candidates)
    trace: dict[str, Any] = {"profile": result.profile, "candidates": len(candidates)}
    if steps is not None and steps.sampled_from is not None:
        trace["sampled_from"] = steps.sampled_from
    if steps is not None:
        trace["removed"] = {name: list(removed) for name, removed in steps.removed}
        trace["scores"] = {
            step.scorer: {
                name: round(score, 4)
                for name, score in zip(steps.scored, step.weighted, strict=True)
                if name in listed
            }
            for step in steps.scorers
        }
    trace["total"] = {name: round(score, 4) for name, score in total.items() if name in listed}
    trace["picked"] = ranking[0] if ranking else source.endpoint
    trace["fallbacks"] = [name for name in ranking[1:] if name in listed]
    made = source.predictions
    if made is not None:
        trace["model_version"] = made.model_version
        trace["predictions"] = {
            name: {
                "ttft_ms": round(p.ttft_ms, 1),
                "tpot_ms": round(p.tpot_ms, 2),
                "ttft_headroom_ms": round(p.ttft_headroom_ms, 1),
                "tpot_headroom_ms": None if p.tpot_headroom_ms is None else round(p.tpot_headroom_ms, 2),
            }
            for name, p in made.by_endpoint.items()
            if name in listed
        }
    trace["fallback"] = source.fallback
    if (omitted := len(set(candidates) - listed)) > 0:
        trace["omitted"] = omitted
    return trace


def _listed(ranking: list[str], total: Mapping[str, float], candidates: tuple[str, ...]) -> set[str]:
    """The endpoints the per-endpoint maps show: the ranking first, then the best totals."""
    order = [*ranking, *sorted(total, key=lambda name: -total[name]), *candidates]
    listed: dict[str, None] = {}
    for name in order:
        if len(listed) == MAX_ENDPOINTS:
            break
        listed.setdefault(name)
    return set(listed)


def _bounded(trace: dict[str, Any]) -> dict[str, Any]:
    for section in ("scores", "predictions", "removed"):
        if len(encode(trace)) <= MAX_BYTES:
            return trace
        trace.pop(section, None)
        trace["truncated"] = True
    return trace


def encode(trace: Mapping[str, Any]) -> str:
    """Compact ASCII JSON (fit for a header value)."""
    return json.dumps(trace, separators=(",", ":"))


class DecisionLog(LifecycleObserver):
    """Puts the decision trace in the debug response header and, at debug level, logs one line
    per finished request: its id, model, endpoint, outcome and trace."""

    def debug_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        return {DECISION_HEADER: encode(decision_trace(routed))}

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        line = {
            "request_id": routed.request.request_id,
            "model": routed.request.model,
            "endpoint": routed.endpoint_name,
            "status": outcome.status,
            "completed": outcome.completed,
            "e2e_ms": round(outcome.e2e_s * 1e3, 1),
            "ttft_ms": None if outcome.ttft_s is None else round(outcome.ttft_s * 1e3, 1),
            "decision": decision_trace(routed),
        }
        log.debug("decision %s", encode(line))
