"""``latency-scorer``: score candidates by predicted latency against the request's SLOs.

With predictions:

* no SLO on the request: the lowest predicted latency scores highest
  (``ttftWeight``·TTFT + ``tpotWeight``·TPOT, each min-max normalised; TPOT only where it binds);
* some endpoint meets the SLO: only those score, by blended headroom — ``least`` prefers the
  smallest positive headroom (best fit: keeps roomy endpoints free for tight requests),
  ``most`` the largest (most slack);
* none meets it: idle endpoints first, then endpoints missing only the TPOT objective, then
  only TTFT, then both; within a group the smallest deficit wins.

Without predictions (predictor down, slow, warming up, or opted out) it falls back to the GIE
default profile's heuristic (``gie-default``): ``(2·relative queue + 2·free KV + 3·prefix
match) / 7``, the queue, KV-cache-utilization and prefix-cache scorers at their weights there.
On the fleet simulator (agentic-weka, 4 replicas, rate scale 16, seeds 0-2, predictions off)
``predicted-latency-token-load`` with this fallback had TTFT p99 526 ms over the first 150 s
and 437 ms overall, with equal weights 569 and 474 ms; at rate scale 8 (seeds 0-4) they tied.

=========================  =======  ======================================================
parameter                  default  meaning
=========================  =======  ======================================================
headroomSelectionStrategy  least    ``least`` (best fit) or ``most`` (most slack)
ttftWeight                 0.8      weight of TTFT in blended latency and headroom
tpotWeight                 0.2      weight of TPOT
=========================  =======  ======================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from epp.latency.predictions import LATENCY_PREDICTIONS, EndpointPrediction
from epp.plugins.kv_cache_utilization_scorer import free_kv_scores
from epp.plugins.prefix_cache import prefix_scores
from epp.scheduling.framework import CycleState, PluginParameters, Scorer
from epp.scheduling.registry import register
from epp.scheduling.scores import min_max_inverse
from epp.scheduling.types import EndpointState, LLMRequest

# Score bands when no endpoint meets the SLO: a better band always outranks a worse one.
_IDLE = 1.0
_BANDS = {"tpot": (0.55, 0.8), "ttft": (0.3, 0.5), "both": (0.05, 0.25)}
# Eligible endpoints never score below this, so a weighted-random picker can still pick them.
_FLOOR = 0.1
# The fallback's weights: gie-default.yaml's queue-scorer, kv-cache-utilization-scorer and
# prefix-cache-scorer.
_QUEUE_WEIGHT, _KV_WEIGHT, _PREFIX_WEIGHT = 2.0, 2.0, 3.0
_FALLBACK_TOTAL = _QUEUE_WEIGHT + _KV_WEIGHT + _PREFIX_WEIGHT


class LatencyScorerParameters(PluginParameters):
    headroom_selection_strategy: Literal["least", "most"] = Field(
        default="least", alias="headroomSelectionStrategy"
    )
    ttft_weight: float = Field(default=0.8, ge=0.0, alias="ttftWeight")
    tpot_weight: float = Field(default=0.2, ge=0.0, alias="tpotWeight")


def _normalised(values: Sequence[float]) -> list[float]:
    """Min-max to [0, 1] (all 0.5 when equal)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.5] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


def composite_heuristic(endpoints: Sequence[EndpointState], state: CycleState) -> list[float]:
    """The fallback: short queue, free KV and prefix match, weighted 2, 2, 3 as in the GIE
    default profile, in [0, 1]."""
    queue = min_max_inverse([e.metrics.waiting for e in endpoints])
    parts = zip(queue, free_kv_scores(endpoints), prefix_scores(endpoints, state), strict=True)
    return [(_QUEUE_WEIGHT * q + _KV_WEIGHT * k + _PREFIX_WEIGHT * p) / _FALLBACK_TOTAL for q, k, p in parts]


@register
class LatencyScorer(Scorer):
    type_name = "latency-scorer"
    Parameters = LatencyScorerParameters
    params: LatencyScorerParameters

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None or not any(e.name in predictions.by_endpoint for e in endpoints):
            return composite_heuristic(endpoints, state)
        by_endpoint = predictions.by_endpoint
        if not predictions.has_slo:
            return self._lowest_latency(endpoints, by_endpoint, predictions.tpot_applies)
        eligible = [e for e in endpoints if e.name in by_endpoint and by_endpoint[e.name].meets_slo]
        if eligible:
            return self._best_headroom(endpoints, eligible, by_endpoint)
        return self._least_deficit(endpoints, by_endpoint)

    def _blend(self, ttft: Sequence[float], tpot: Sequence[float] | None) -> list[float]:
        ttft_n = _normalised(ttft)
        if tpot is None:
            return ttft_n
        w1, w2 = self.params.ttft_weight, self.params.tpot_weight
        total = (w1 + w2) or 1.0
        return [(w1 * a + w2 * b) / total for a, b in zip(ttft_n, _normalised(tpot), strict=True)]

    def _lowest_latency(
        self, endpoints: Sequence[EndpointState], by: dict[str, EndpointPrediction], tpot_applies: bool
    ) -> list[float]:
        known = [e for e in endpoints if e.name in by]
        blended = self._blend(
            [by[e.name].ttft_ms for e in known], [by[e.name].tpot_ms for e in known] if tpot_applies else None
        )
        scores = {e.name: _FLOOR + (1 - _FLOOR) * (1.0 - b) for e, b in zip(known, blended, strict=True)}
        return [scores.get(e.name, 0.0) for e in endpoints]

    def _best_headroom(
        self,
        endpoints: Sequence[EndpointState],
        eligible: list[EndpointState],
        by: dict[str, EndpointPrediction],
    ) -> list[float]:
        tpot_binds = all(by[e.name].tpot_headroom_ms is not None for e in eligible)
        blended = self._blend(
            [by[e.name].ttft_headroom_ms for e in eligible],
            [by[e.name].tpot_headroom_ms or 0.0 for e in eligible] if tpot_binds else None,
        )
        if self.params.headroom_selection_strategy == "least":
            blended = [1.0 - b for b in blended]
        scores = {e.name: _FLOOR + (1 - _FLOOR) * b for e, b in zip(eligible, blended, strict=True)}
        return [scores.get(e.name, 0.0) for e in endpoints]

    def _least_deficit(
        self, endpoints: Sequence[EndpointState], by: dict[str, EndpointPrediction]
    ) -> list[float]:
        groups: dict[str, list[tuple[EndpointState, float]]] = {"tpot": [], "ttft": [], "both": []}
        scores: dict[str, float] = {}
        for e in endpoints:
            p = by.get(e.name)
            if p is None:
                continue
            if e.metrics.running == 0 and e.metrics.waiting == 0:
                scores[e.name] = _IDLE
                continue
            ttft_short = p.ttft_headroom_ms < 0
            tpot_short = p.tpot_headroom_ms is not None and p.tpot_headroom_ms < 0
            group = "both" if ttft_short and tpot_short else ("ttft" if ttft_short else "tpot")
            deficit = -min(p.ttft_headroom_ms, 0.0) - min(p.tpot_headroom_ms or 0.0, 0.0)
            groups[group].append((e, deficit))
        for group, members in groups.items():
            if not members:
                continue
            lo, hi = _BANDS[group]
            for (e, _), rank in zip(members, min_max_inverse([d for _, d in members]), strict=True):
                scores[e.name] = lo + (hi - lo) * rank
        return [scores.get(e.name, 0.0) for e in endpoints]
