"""Load-balancing baselines that look only at how busy each endpoint is.

``least-request`` (scorer)
  Prefers endpoints with fewer requests in flight, as the EPP counts them (routed, not yet
  finished; no scrape lag). Score = (max − n) / (max − min) over the candidates; all 1.0 when
  equal. With ``max-score-picker`` it is the classic least-request balancer. No parameters.

``power-of-two`` (filter)
  Power of two choices, Ray Serve's default router: samples two candidates with the injected
  RNG and keeps the less loaded one (a random one of the two on a tie); with one candidate,
  keeps it.

  ========  ========  ===========================================================
  parameter default   meaning
  ========  ========  ===========================================================
  load      requests  ``requests``: in-flight requests; ``tokens``: in-flight
                      prefill + decode tokens (``token-load-producer``)
  ========  ========  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from epp.load.token_load import NO_LOAD
from epp.scheduling.cycle_data import TOKEN_LOAD
from epp.scheduling.framework import CycleState, Filter, PluginParameters, Scorer
from epp.scheduling.registry import register
from epp.scheduling.scores import min_max_inverse
from epp.scheduling.types import EndpointState, LLMRequest


@register
class LeastRequestScorer(Scorer):
    type_name = "least-request"

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return min_max_inverse([e.in_flight for e in endpoints])


class PowerOfTwoParameters(PluginParameters):
    load: Literal["requests", "tokens"] = "requests"


@register
class PowerOfTwoFilter(Filter):
    type_name = "power-of-two"
    Parameters = PowerOfTwoParameters
    consumes = (TOKEN_LOAD,)
    params: PowerOfTwoParameters

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]:
        if len(endpoints) < 2:
            return list(endpoints)
        first, second = self.context.rng.sample(list(endpoints), 2)
        if self.params.load == "tokens":
            loads = state.get(TOKEN_LOAD) or {}

            def load(e: EndpointState) -> int:
                return loads.get(e.name, NO_LOAD).tokens_in_flight
        else:

            def load(e: EndpointState) -> int:
                return e.in_flight

        return [second if load(second) < load(first) else first]
