"""``prefix-cache-affinity-filter``: keep the request where its prompt is cached, within reason.

Keeps the endpoints whose prefix-cache match is at least ``affinityThreshold`` ("sticky"
endpoints); keeps every candidate when none is sticky. Three escapes stop affinity from piling
work onto one endpoint:

* exploration: with probability ``explorationProbability`` every candidate is kept;
* the TTFT load gate: when the best sticky endpoint's predicted TTFT is more than
  ``maxTTFTPenaltyMs`` worse than the best non-sticky one's, every candidate is kept. With
  ``gateOnExpectedOutput``, a request whose answer length is estimated (a hint or learned,
  ``EXPECTED_OUTPUT``) is judged by its predicted end-to-end time,
  ``TTFT + (expected output − 1) · TPOT``, instead: a long answer cached on a slow or crowded
  endpoint moves when decoding it elsewhere saves more than
  ``maxTTFTPenaltyMs`` (re-prefilling the prompt included in the other endpoint's TTFT).
* the token-load gate, where there are no predictions (the model warming up, the predictor
  down, or the producer's ``skipWhenCachedAt``) and ``maxLoadPenaltyTokens`` is set: when the
  best sticky endpoint's token-load cost is more than ``maxLoadPenaltyTokens`` above the best
  non-sticky one's, every candidate is kept. The cost is the Dynamo KV router's
  (``epp.load.token_load.token_cost``: prefill still to do there, this prompt's uncached part
  included, plus the KV tokens booked there), times the endpoint's measured slowness where
  ``ENDPOINT_SPEED`` is known. Without it, or without the EPP's token load, the filter cannot
  judge without predictions and sticks. So it does while this EPP syncs with live peer
  replicas (``epp.sync.hook`` calls :meth:`PrefixCacheAffinityFilter.join_replicas`).

The token-load gate is what breaks a burst of one prompt up. RL rollouts and fan-out agents send
the same prompt many times at once; after the first is routed the prompt reads as cached where
it went, and the engines' metrics show no queue there for a scrape, so without the gate every
copy sticks to one endpoint, and the conversations that grow from them stay there and queue
behind each other at every later turn (``docs/mixed-pools.md``, "Bursts of one prompt").
The gate needs the bookings made a moment ago; synced replicas see each other's a sync lag
late, and in a burst each would move its copies onto the endpoint that looks emptiest to it, the
same one for all. Measured, no extra cost on moving did better than a shut gate at every
replica count, and a shut gate is never worse than the filter was without the gate.

Prefix scores are bimodal in practice (a prompt is cached somewhere, or nowhere), which is
why a high threshold works.

======================  =======  ==========================================================
parameter               default  meaning
======================  =======  ==========================================================
affinityThreshold       0.80     minimum prefix match (fraction of prompt blocks) to stick
explorationProbability  0.0      chance of ignoring affinity for one request
maxTTFTPenaltyMs        5000     predicted-TTFT cost (ms) beyond which affinity is dropped
gateOnExpectedOutput    false    judge requests with an estimated output by predicted E2E
maxLoadPenaltyTokens    none     without predictions: token-load cost (tokens) beyond
                                 which affinity is dropped; none: stick
======================  =======  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import Field

from epp.plugins.token_load import token_costs
from epp.scheduling.cycle_data import ENDPOINT_SPEED, EXPECTED_OUTPUT, PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import CycleState, Filter, PluginContext, PluginParameters
from epp.scheduling.predictions import LATENCY_PREDICTIONS, EndpointPrediction, LatencyPredictions
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class PrefixAffinityParameters(PluginParameters):
    affinity_threshold: float = Field(default=0.80, ge=0.0, le=1.0, alias="affinityThreshold")
    exploration_probability: float = Field(default=0.0, ge=0.0, le=1.0, alias="explorationProbability")
    max_ttft_penalty_ms: float = Field(default=5000.0, ge=0.0, alias="maxTTFTPenaltyMs")
    gate_on_expected_output: bool = Field(default=False, alias="gateOnExpectedOutput")
    max_load_penalty_tokens: float | None = Field(default=None, ge=0.0, alias="maxLoadPenaltyTokens")


@register
class PrefixCacheAffinityFilter(Filter):
    type_name = "prefix-cache-affinity-filter"
    Parameters = PrefixAffinityParameters
    consumes = (PREFIX_MATCH,)
    reads_if_present = (LATENCY_PREDICTIONS, EXPECTED_OUTPUT, TOKEN_LOAD, ENDPOINT_SPEED)
    params: PrefixAffinityParameters

    def __init__(self, name: str, params: PrefixAffinityParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._live_peers: Callable[[], int] | None = None

    def join_replicas(self, live_peers: Callable[[], int]) -> None:
        """This EPP syncs with peer replicas: while ``live_peers()`` counts any, the token-load
        gate stays shut."""
        self._live_peers = live_peers

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
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None:
            gate_open = self._load_gate_open(request, sticky, endpoints, state)
        else:
            gate_open = self._gate_open(predictions, sticky, endpoints, state)
        return list(endpoints) if gate_open else sticky

    def _load_gate_open(
        self,
        request: LLMRequest,
        sticky: list[EndpointState],
        endpoints: Sequence[EndpointState],
        state: CycleState,
    ) -> bool:
        penalty = self.params.max_load_penalty_tokens
        among_peers = self._live_peers is not None and self._live_peers() > 0
        if penalty is None or TOKEN_LOAD not in state or among_peers:
            return False
        sticky_names = {e.name for e in sticky}
        costs = token_costs(request, endpoints, state)
        best_sticky = min(c for e, c in zip(endpoints, costs, strict=True) if e.name in sticky_names)
        best_other = min(c for e, c in zip(endpoints, costs, strict=True) if e.name not in sticky_names)
        return best_sticky - best_other > penalty

    def _gate_open(
        self,
        predictions: LatencyPredictions,
        sticky: list[EndpointState],
        endpoints: Sequence[EndpointState],
        state: CycleState,
    ) -> bool:
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
