"""``token-load-scorer``: the Dynamo KV router's cost (also Ray's KVAwareRouter), as a score.

Per candidate, in blocks of ``blockSizeTokens`` (B)::

    cost = prefillLoadScale · (active_prefill_tokens + ISL − overlap_tokens) / B + active_decode_blocks

``active_prefill_tokens`` (uncached prompt tokens not yet prefilled) and
``active_decode_blocks`` (KV tokens of every active request there, prompt + generated, / B;
Dynamo books a request's blocks as active from the moment it routes it) are the EPP's own
in-flight token load there (``token-load-producer``); ``overlap_tokens`` are the prompt tokens
the prefix match says are cached there. Blocks shared by requests are not deduplicated
(Dynamo's ``assume_kv_reuse`` off). Costs are mapped linearly to scores, lowest cost → 1,
highest → 0 (all 1 when equal), which is exactly Dynamo's normalisation
``(c − c_min)/(c_max − c_min)``; so ``max-score-picker`` reproduces Dynamo at temperature 0
(argmin, ties at random) and ``softmax-picker`` with ``temperature: T`` reproduces its
sampling at T > 0.

================  =======  ==========================================================
parameter         default  meaning
================  =======  ==========================================================
prefillLoadScale  1.0      weight of a prefill block against a decode block
blockSizeTokens   16       tokens per block (vLLM's default KV block size)
================  =======  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.load.token_load import NO_LOAD
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import CycleState, PluginParameters, Scorer
from epp.scheduling.registry import register
from epp.scheduling.scores import min_max_inverse
from epp.scheduling.types import EndpointState, LLMRequest


class TokenLoadScorerParameters(PluginParameters):
    prefill_load_scale: float = Field(default=1.0, ge=0.0, le=1000.0, alias="prefillLoadScale")
    block_size_tokens: int = Field(default=16, ge=1, alias="blockSizeTokens")


@register
class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"
    Parameters = TokenLoadScorerParameters
    consumes = (TOKEN_LOAD, PREFIX_MATCH)
    params: TokenLoadScorerParameters

    def costs(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        """Each candidate's cost in blocks (lower is better)."""
        loads = state.get(TOKEN_LOAD) or {}
        match = state.get(PREFIX_MATCH)
        isl = request.input_tokens
        block = self.params.block_size_tokens
        scale = self.params.prefill_load_scale
        costs = []
        for e in endpoints:
            load = loads.get(e.name, NO_LOAD)
            overlap = match.cached_tokens(e.name, isl) if match else 0
            prefill = load.prefill_tokens + isl - overlap
            costs.append(scale * prefill / block + load.kv_tokens / block)
        return costs

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return min_max_inverse(self.costs(request, endpoints, state))
