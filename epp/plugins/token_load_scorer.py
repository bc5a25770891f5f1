"""``token-load-scorer``: the Dynamo KV router's cost (also Ray's KVAwareRouter), as a score.

Per candidate, in blocks of ``blockSizeTokens`` (B)::

    cost = prefillLoadScale · (active_prefill_tokens + ISL − overlap_tokens) / B + active_decode_blocks
           + expectedOutputWeight · expected_remaining_output_tokens / B

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

``expected_remaining_output_tokens`` are the output tokens the requests booked there are still
expected to generate (each one's expected output less what it streamed, ``EXPECTED_OUTPUT``):
the decoding still to come, which the blocks held now do not show (a 1k-token answer and an
8k-token one that just started hold the same blocks). Off (0) by default: without a client's
hint or learned lengths (``token-load-producer``'s ``learnSessionOutput``) the expectation is
only ``max_tokens`` or a ratio of the prompt.

====================  =======  ==========================================================
parameter             default  meaning
====================  =======  ==========================================================
prefillLoadScale      1.0      weight of a prefill block against a decode block
blockSizeTokens       16       tokens per block (vLLM's default KV block size)
replicaMoveMargin     0        on synced EPP replicas only (below): extra cost of moving a
                               conversation off its endpoint, per live peer, in units of
                               the prompt's blocks
expectedOutputWeight  0        weight of a block of expected remaining output (above)
====================  =======  ==========================================================

With ``endpoint-speed-producer`` in the config (``ENDPOINT_SPEED``), each endpoint's cost is
multiplied by its measured slowness, so the cost counts the time its work takes rather than its
tokens: on a pool of 2 engines and 2 engines 2.5 times slower, a slow one with 400 blocks costs
what a fast one with 1,000 does. Without it (or on an endpoint not yet measured) costs are in
blocks as above.

``replicaMoveMargin`` (m). Synced replicas see each other's picks a sync lag late, so in a burst
(RL rollouts whose turns all end together) each replica reads an endpoint as emptier than it is
by what its peers sent there in the last lag, and several move conversations onto the same
endpoint that looked cheapest; those moves lose their prefix caches and unbalance the next burst.
While peers are alive (``epp.sync.hook`` calls :meth:`TokenLoadScorer.join_replicas`) and an
endpoint holds most of the prompt (its prefix match, the longest, covers at least half the
prompt's blocks: the conversation's endpoint), every other endpoint costs
m · live peers · ISL / B more: what one unseen pick of the same size from each peer would have
added there. Staying needs no margin: the peers' earlier turns still booked on the
conversation's endpoint stand in for their unseen next turns. 0 (the default) turns it off, and
an EPP alone (no live peer) scores exactly as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import Field

from epp.plugins.token_load import token_costs
from epp.scheduling.cycle_data import ENDPOINT_SPEED, PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import CycleState, PluginContext, PluginParameters, Scorer
from epp.scheduling.registry import register
from epp.scheduling.scores import min_max_inverse
from epp.scheduling.types import EndpointState, LLMRequest


class TokenLoadScorerParameters(PluginParameters):
    prefill_load_scale: float = Field(default=1.0, ge=0.0, le=1000.0, alias="prefillLoadScale")
    block_size_tokens: int = Field(default=16, ge=1, alias="blockSizeTokens")
    replica_move_margin: float = Field(default=0.0, ge=0.0, le=100.0, alias="replicaMoveMargin")
    expected_output_weight: float = Field(default=0.0, ge=0.0, le=100.0, alias="expectedOutputWeight")


@register
class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"
    Parameters = TokenLoadScorerParameters
    consumes = (TOKEN_LOAD, PREFIX_MATCH)
    reads_if_present = (ENDPOINT_SPEED,)
    params: TokenLoadScorerParameters

    def __init__(self, name: str, params: TokenLoadScorerParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._live_peers: Callable[[], int] | None = None

    def join_replicas(self, live_peers: Callable[[], int]) -> None:
        """This EPP syncs with peer replicas (``epp.sync.hook`` calls this): ``live_peers()`` counts
        those alive, for ``replicaMoveMargin``."""
        self._live_peers = live_peers if self.params.replica_move_margin > 0 else None

    def costs(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        """Each candidate's cost in blocks, times its slowness where measured (lower is better)."""
        match = state.get(PREFIX_MATCH)
        isl = request.input_tokens
        p = self.params
        costs = token_costs(
            request, endpoints, state, p.prefill_load_scale, p.expected_output_weight, p.block_size_tokens
        )
        margin = self._move_margin(isl) if match is not None and match.matched_blocks else 0.0
        if margin and match is not None:
            home = max(match.matched_blocks.values())
            if 2 * home >= match.total_blocks > 0:
                costs = [
                    c if match.matched_blocks.get(e.name, 0) == home else c + margin
                    for e, c in zip(endpoints, costs, strict=True)
                ]
        return costs

    def _move_margin(self, prompt_tokens: int) -> float:
        """The extra cost of a move off the conversation's endpoint now (0 without live peers)."""
        peers = self._live_peers() if self._live_peers is not None else 0
        return self.params.replica_move_margin * peers * prompt_tokens / self.params.block_size_tokens

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return min_max_inverse(self.costs(request, endpoints, state))
