"""``latency-scorer``: score candidates by predicted latency against the request's SLOs.

With predictions:

* no SLO on the request: the lowest predicted latency scores highest
  (``ttftWeight``·TTFT + ``tpotWeight``·TPOT, each min-max normalised; TPOT only where it binds);
* some endpoint meets the SLO: only those score, by blended headroom — ``least`` prefers the
  smallest positive headroom (best fit: keeps roomy endpoints free for tight requests),
  ``most`` the largest (most slack);
* none meets it: idle endpoints first, then endpoints missing only the TPOT objective, then
  only TTFT, then both; within a group the smallest deficit wins.

Without predictions (predictor down, slow, warming up, or opted out) it falls back to a
heuristic: the GIE default profile's (``gie-default``), ``(2·relative queue + 2·free KV +
3·prefix match) / 7``, the queue, KV-cache-utilization and prefix-cache scorers at their weights
there. Where the EPP counts its own in-flight token load (``token-load-producer`` in the
config), the fallback is the mean of that and the prefill work the request would wait for and
do, which the scraped metrics see late or not at all (a long prefill running is one request,
not a queue): ``work = prefill tokens routed there and not yet prefilled + this prompt's
tokens not cached there``, scored ``(lowest work + S) / (work + S)`` with ``S`` = 1,024
tokens, about what an engine step's fixed cost is worth in prefill (16.5 ms against 0.015 ms a
token in the ``default`` profile), so that equal work ties and a few hundred tokens barely count.
With ``endpoint-speed-producer`` in the config, each endpoint's ``work + S`` is multiplied by its
measured slowness: until the model is trained, a replica 2.5 times slower is scored by the time
its work takes, not sent as much as the others.

=========================  =======  ======================================================
parameter                  default  meaning
=========================  =======  ======================================================
headroomSelectionStrategy  least    ``least`` (best fit) or ``most`` (most slack)
ttftWeight                 0.8      weight of TTFT in blended latency and headroom
tpotWeight                 0.2      weight of TPOT
weighByExpectedOutputFrom  none     when the request's output length is estimated (a
                                    hint or learned, ``EXPECTED_OUTPUT``) at this many
                                    tokens or more, weigh TTFT and TPOT by their shares of
                                    its predicted end-to-end time
=========================  =======  ======================================================

With ``weighByExpectedOutputFrom`` a request expected to answer ``O`` tokens (at least that
many) weighs TTFT by the lowest predicted TTFT and TPOT by ``(O − 1) ×`` the lowest predicted
TPOT: the two terms of its predicted end-to-end time, ``TTFT + (O − 1) · TPOT``; with no SLO that
ranks candidates by predicted E2E. A long answer is routed for its decoding speed. Shorter ones
keep the configured weights: weighed by E2E, a 1k-token answer's TPOT term is 100 times its TTFT
term even between equal engines, where TPOT predictions differ by noise, and in the fleet
simulator that cost TTFT p99 (``docs/output-length.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from epp.load.token_load import NO_LOAD
from epp.plugins.kv_cache_utilization_scorer import free_kv_scores
from epp.plugins.prefix_cache import PREFIX_MATCH, prefix_scores
from epp.plugins.token_load import TOKEN_LOAD
from epp.scheduling.cycle_data import ENDPOINT_SPEED, EXPECTED_OUTPUT
from epp.scheduling.framework import CycleState, PluginParameters, Scorer
from epp.scheduling.predictions import LATENCY_PREDICTIONS, EndpointPrediction
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
# Prefill tokens that cost about as much as an engine step's fixed overhead (see the docstring).
_STEP_TOKENS = 1024.0


class LatencyScorerParameters(PluginParameters):
    headroom_selection_strategy: Literal["least", "most"] = Field(
        default="least", alias="headroomSelectionStrategy"
    )
    ttft_weight: float = Field(default=0.8, ge=0.0, alias="ttftWeight")
    tpot_weight: float = Field(default=0.2, ge=0.0, alias="tpotWeight")
    weigh_by_expected_output_from: int | None = Field(default=None, ge=1, alias="weighByExpectedOutputFrom")


def _normalised(values: Sequence[float], min_span: float) -> list[float]:
    """Offsets from the lowest value over their spread, in [0, 1]; a spread under ``min_span``
    counts as ``min_span`` (all 0.5 when equal)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.5] * len(values)
    span = max(hi - lo, min_span)
    return [(v - lo) / span for v in values]


def composite_heuristic(endpoints: Sequence[EndpointState], state: CycleState) -> list[float]:
    """The fallback: short queue, free KV and prefix match, weighted 2, 2, 3 as in the GIE
    default profile, in [0, 1]."""
    queue = min_max_inverse([e.metrics.waiting for e in endpoints])
    parts = zip(queue, free_kv_scores(endpoints, "percent"), prefix_scores(endpoints, state), strict=True)
    return [(_QUEUE_WEIGHT * q + _KV_WEIGHT * k + _PREFIX_WEIGHT * p) / _FALLBACK_TOTAL for q, k, p in parts]


def prefill_work_scores(
    request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
) -> list[float] | None:
    """The prefill work the request would wait for and do on each endpoint, from the EPP's
    token load (in time, where ``ENDPOINT_SPEED`` measures each endpoint's slowness), as a score
    in (0, 1]; None without a token load in ``state``."""
    loads = state.get(TOKEN_LOAD)
    if loads is None:
        return None
    match = state.get(PREFIX_MATCH)
    isl = request.input_tokens
    slowness = state.get(ENDPOINT_SPEED) or {}
    work = [
        (
            loads.get(e.name, NO_LOAD).prefill_tokens
            + isl
            - (match.cached_tokens(e.name, isl) if match else 0)
            + _STEP_TOKENS
        )
        * slowness.get(e.name, 1.0)
        for e in endpoints
    ]
    lowest = min(work)
    return [lowest / w for w in work]


def fallback_scores(
    request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
) -> list[float]:
    """The scores without predictions: the composite heuristic, averaged with the prefill work
    where the EPP counts its token load."""
    composite = composite_heuristic(endpoints, state)
    work = prefill_work_scores(request, endpoints, state)
    if work is None:
        return composite
    return [(c + w) / 2 for c, w in zip(composite, work, strict=True)]


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
            return fallback_scores(request, endpoints, state)
        by_endpoint = predictions.by_endpoint
        weights = self._weights(state, list(by_endpoint.values()))
        if not predictions.has_slo:
            return self._lowest_latency(endpoints, by_endpoint, predictions.tpot_applies, weights)
        eligible = [e for e in endpoints if e.name in by_endpoint and by_endpoint[e.name].meets_slo]
        if eligible:
            return self._best_headroom(endpoints, eligible, by_endpoint, weights)
        return self._least_deficit(endpoints, by_endpoint)

    def _weights(self, state: CycleState, predicted: Sequence[EndpointPrediction]) -> tuple[float, float]:
        """(TTFT weight, TPOT weight) for this request (see ``weighByExpectedOutputFrom``)."""
        configured = self.params.ttft_weight, self.params.tpot_weight
        threshold = self.params.weigh_by_expected_output_from
        expected = state.get(EXPECTED_OUTPUT) if threshold is not None else None
        if threshold is None or expected is None or not expected.estimated or expected.tokens < threshold:
            return configured
        ttft = min(p.ttft_ms for p in predicted)
        decode = (expected.tokens - 1) * min(p.tpot_ms for p in predicted)
        return (ttft, decode) if ttft + decode > 0 else configured

    def _blend(
        self,
        ttft: Sequence[float],
        tpot: Sequence[float] | None,
        predicted: Sequence[EndpointPrediction],
        weights: tuple[float, float],
    ) -> list[float]:
        """Each value's normalised offset, TTFT and TPOT blended. A difference counts in full only
        when it is as large as the lowest predicted latency itself: plain min-max would turn a 2 ms
        difference between 50 ms predictions (noise, for a model with 15% error) into the full
        range of scores and override every other scorer."""
        ttft_n = _normalised(ttft, min(p.ttft_ms for p in predicted))
        if tpot is None:
            return ttft_n
        tpot_n = _normalised(tpot, min(p.tpot_ms for p in predicted))
        w1, w2 = weights
        total = (w1 + w2) or 1.0
        return [(w1 * a + w2 * b) / total for a, b in zip(ttft_n, tpot_n, strict=True)]

    def _lowest_latency(
        self,
        endpoints: Sequence[EndpointState],
        by: dict[str, EndpointPrediction],
        tpot_applies: bool,
        weights: tuple[float, float],
    ) -> list[float]:
        known = [e for e in endpoints if e.name in by]
        blended = self._blend(
            [by[e.name].ttft_ms for e in known],
            [by[e.name].tpot_ms for e in known] if tpot_applies else None,
            [by[e.name] for e in known],
            weights,
        )
        scores = {e.name: _FLOOR + (1 - _FLOOR) * (1.0 - b) for e, b in zip(known, blended, strict=True)}
        return [scores.get(e.name, 0.0) for e in endpoints]

    def _best_headroom(
        self,
        endpoints: Sequence[EndpointState],
        eligible: list[EndpointState],
        by: dict[str, EndpointPrediction],
        weights: tuple[float, float],
    ) -> list[float]:
        tpot_binds = all(by[e.name].tpot_headroom_ms is not None for e in eligible)
        blended = self._blend(
            [by[e.name].ttft_headroom_ms for e in eligible],
            [by[e.name].tpot_headroom_ms or 0.0 for e in eligible] if tpot_binds else None,
            [by[e.name] for e in eligible],
            weights,
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
