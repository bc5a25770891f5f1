"""``candidate-sampler``: the endpoints one scheduling cycle examines in a large pool.

Every producer, filter and scorer after it does Python work per endpoint (predicted-latency
over 100 endpoints: ~0.75 ms a request more than over 4, and a prediction row each), so a
router that examines the whole pool pays for its size on every request. The sampler hands the
rest of the cycle at most ``maxCandidates`` endpoints, chosen in this order:

1. the ``prefixCandidates`` endpoints holding most of the prompt's leading blocks
   (``PREFIX_MATCH``, when the config produces it): where the prompt is cached;
2. the ``leastLoadedCandidates`` endpoints with the fewest requests queued and running at their
   last scrape plus this EPP's own requests in flight there (ties in a random rotation of the
   pool, so an idle pool is not always sampled from its head);
3. endpoints drawn at random (the injected RNG) for the rest, so that each endpoint is examined
   now and then whatever the load view says.

Half the sample is random by default because a request count is a poor view of a mixed pool:
its slow replicas, which the predictions avoid, look the least busy and would crowd the sample
(docs/candidate-sampling.md: 8 least busy cost a 50/50 pool of 100 up to +21% TTFT p99).

The sample keeps the pool's order. A pool of ``maxCandidates`` endpoints or fewer passes whole,
so the sampler changes nothing there. An admitter after it judges the sample: a sheddable
request is refused when no sampled endpoint is predicted to meet its SLO. A plugin that must see
the whole pool does not go with it: ``session-affinity``'s hash ring, built over the sample,
would move sessions from request to request.

========================  =======  ===========================================================
parameter                 default  meaning
========================  =======  ===========================================================
maxCandidates             16       endpoints the cycle examines at most (≥ 1)
prefixCandidates          4        of them, those holding the longest cached prefix
leastLoadedCandidates     4        of them, the least busy; the rest are drawn at random
========================  =======  ===========================================================
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import itemgetter

from pydantic import Field, model_validator

from epp.scheduling.cycle_data import PREFIX_MATCH, PrefixMatch
from epp.scheduling.framework import CandidateSampler, CycleState, PluginContext, PluginParameters
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class CandidateSamplerParameters(PluginParameters):
    max_candidates: int = Field(default=16, ge=1, alias="maxCandidates")
    prefix_candidates: int = Field(default=4, ge=0, alias="prefixCandidates")
    least_loaded_candidates: int = Field(default=4, ge=0, alias="leastLoadedCandidates")

    @model_validator(mode="after")
    def _fits(self) -> CandidateSamplerParameters:
        if self.prefix_candidates + self.least_loaded_candidates > self.max_candidates:
            raise ValueError("prefixCandidates + leastLoadedCandidates exceeds maxCandidates")
        return self


def busy(endpoint: EndpointState) -> int:
    """Requests queued and running at the last scrape, plus this EPP's own in flight."""
    m = endpoint.metrics
    return m.waiting + m.running + endpoint.in_flight


@register
class PrefixLoadSampler(CandidateSampler):
    type_name = "candidate-sampler"
    Parameters = CandidateSamplerParameters
    reads_if_present = (PREFIX_MATCH,)
    params: CandidateSamplerParameters

    def __init__(self, name: str, params: CandidateSamplerParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.rng = context.rng

    def sample(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> Sequence[EndpointState]:
        size = self.params.max_candidates
        if len(endpoints) <= size:
            return endpoints
        chosen = self._cached(endpoints, state.get(PREFIX_MATCH))
        start = self.rng.randrange(len(endpoints))
        rotated = [e for e in (*endpoints[start:], *endpoints[:start]) if id(e) not in chosen]
        chosen.update(id(e) for e in heapq.nsmallest(self.params.least_loaded_candidates, rotated, key=busy))
        rest = [e for e in rotated if id(e) not in chosen]
        chosen.update(id(e) for e in self.rng.sample(rest, min(len(rest), size - len(chosen))))
        return [e for e in endpoints if id(e) in chosen]

    def _cached(self, endpoints: Sequence[EndpointState], match: PrefixMatch | None) -> set[int]:
        """The endpoints (by ``id``) holding the most of the prompt's blocks."""
        wanted = self.params.prefix_candidates
        if match is None or not match.matched_blocks or wanted == 0:
            return set()
        pool = {e.name: e for e in endpoints}
        held = ((pool[name], n) for name, n in match.matched_blocks.items() if n > 0 and name in pool)
        return {id(e) for e, _ in heapq.nlargest(wanted, held, key=itemgetter(1))}
