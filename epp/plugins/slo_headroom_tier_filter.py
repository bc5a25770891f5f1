"""``slo-headroom-tier-filter``: prefer endpoints predicted to meet the request's SLOs.

Splits the candidates into a positive tier (every binding headroom ≥ 0) and a negative tier.
When both exist it keeps the positive tier, except with probability ``epsilonExploreNeg``,
when it keeps the negative one, so predictions for loaded endpoints keep being tested
against reality. With one tier, or without predictions, it keeps every candidate.

=================  =======  ===========================================================
parameter          default  meaning
=================  =======  ===========================================================
epsilonExploreNeg  0.01     chance of routing to the negative tier when both exist
=================  =======  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.scheduling.framework import CycleState, Filter, PluginParameters
from epp.scheduling.predictions import LATENCY_PREDICTIONS
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class SloHeadroomTierParameters(PluginParameters):
    epsilon_explore_neg: float = Field(default=0.01, ge=0.0, le=1.0, alias="epsilonExploreNeg")


@register
class SloHeadroomTierFilter(Filter):
    type_name = "slo-headroom-tier-filter"
    Parameters = SloHeadroomTierParameters
    consumes = (LATENCY_PREDICTIONS,)
    params: SloHeadroomTierParameters

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]:
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None or not predictions.has_slo:
            return list(endpoints)
        by_endpoint = predictions.by_endpoint
        positive = [e for e in endpoints if e.name in by_endpoint and by_endpoint[e.name].meets_slo]
        negative = [e for e in endpoints if e not in positive]
        if not positive or not negative:
            return list(endpoints)
        if self.context.rng.random() < self.params.epsilon_explore_neg:
            return negative
        return positive
