"""``prefix-cache-affinity-filter``: keep the request where its prompt is cached, within reason.

Keeps the endpoints whose prefix-cache match is at least ``affinityThreshold`` ("sticky"
endpoints); keeps every candidate when none is sticky. Two escapes stop affinity from piling
work onto one endpoint:

* exploration: with probability ``explorationProbability`` every candidate is kept;
* the TTFT load gate: when the best sticky endpoint's predicted TTFT is more than
  ``maxTTFTPenaltyMs`` worse than the best non-sticky one's, every candidate is kept.
  Without predictions the gate cannot judge and stays shut. With ``gateOnExpectedOutput``, a
  request whose answer length is estimated (a hint or learned, ``EXPECTED_OUTPUT``) is judged
  by its predicted end-to-end time, ``TTFT + (expected output − 1) · TPOT``, instead: a long
  answer cached on a slow or crowded endpoint moves when decoding it elsewhere saves more than
  ``maxTTFTPenaltyMs`` (re-prefilling the prompt included in the other endpoint's TTFT).

Prefix scores are bimodal in practice (a prompt is cached somewhere, or nowhere), which is
why a high threshold works.

======================  =======  ==========================================================
parameter               default  meaning
======================  =======  ==========================================================
affinityThreshold       0.80     minimum prefix match (fraction of prompt blocks) to stick
explorationProbability  0.0      chance of ignoring affinity for one request
maxTTFTPenaltyMs        5000     predicted-TTFT cost (ms) beyond which affinity is dropped
gateOnExpectedOutput    false    judge requests with an estimated output by predicted E2E
======================  =======  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.latency.predictions import LATENCY_PREDICTIONS, EndpointPrediction
from epp.scheduling.cycle_data import EXPECTED_OUTPUT, PREFIX_MATCH
from epp.scheduling.framework import CycleState, Filter, PluginParameters
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class PrefixAffinityParameters(PluginParameters):
    affinity_threshold: float = Field(default=0.80, ge=0.0, le=1.0, alias="affinityThreshold")
    exploration_probability: float = Field(default=0.0, ge=0.0, le=1.0, alias="explorationProbability")
    max_ttft_penalty_ms: float = Field(default=5000.0, ge=0.0, alias="maxTTFTPenaltyMs")
    gate_on_expected_output: bool = Field(default=False, alias="gateOnExpectedOutput")


@register
class PrefixCacheAffinityFilter(Filter):
    type_name = "prefix-cache-affinity-filter"
    Parameters = PrefixAffinityParameters
    consumes = (PREFIX_MATCH,)
    params: PrefixAffinityParameters

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]:
        match = state.get(PREFIX_MATCH)
        if match is None:
            return list(endpoints)
        sticky = [e for e in endpoints if match.fraction(e.name) >= self.params.affinity_threshold]
        if not sticky or len(sticky) == len(endpoints):
            return list(endpoints)
        if self.context.rng.random() < self.params.exploration_probability:
            return list(endpoints)
        if self._gate_open(sticky, endpoints, state):
            return list(endpoints)
        return sticky

    def _gate_open(
        self, sticky: list[EndpointState], endpoints: Sequence[EndpointState], state: CycleState
    ) -> bool:
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None:
            return False
        sticky_names = {e.name for e in sticky}
        by = predictions.by_endpoint
        expected = state.get(EXPECTED_OUTPUT) if self.params.gate_on_expected_output else None
        decode_tokens = expected.tokens - 1 if expected is not None and expected.estimated else 0

        def cost(p: EndpointPrediction) -> float:
            return p.ttft_ms + decode_tokens * p.tpot_ms

        best_sticky = min((cost(by[e.name]) for e in sticky if e.name in by), default=None)
        best_other = min(
            (cost(by[e.name]) for e in endpoints if e.name not in sticky_names and e.name in by),
            default=None,
        )
        if best_sticky is None or best_other is None:
            return False
        return best_sticky - best_other > self.params.max_ttft_penalty_ms
