"""``kv-affinity`` (filter): keep the endpoints holding the longest cached prefix of the prompt.

Pure maximum overlap, blind to load: the comparison arm that shows why cache affinity alone
piles a shared prefix onto one replica. Keeps every candidate whose prefix match (in blocks,
from the ``prefix-cache-match`` data) equals the best; what follows in the profile breaks ties.
With ``minMatchRatio`` it becomes the first tier of Ray's PrefixCacheAffinityRouter: when the
best match covers less than that fraction of the prompt, every candidate is kept (and, e.g., a
``power-of-two`` filter after it balances by load).

=============  =======  ================================================================
parameter      default  meaning
=============  =======  ================================================================
minMatchRatio  0.0      best match (fraction of prompt blocks) below which affinity is
                        dropped; 0 keeps the best-overlap endpoints whenever any overlap
                        exists
=============  =======  ================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import CycleState, Filter, PluginParameters
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class KVAffinityParameters(PluginParameters):
    min_match_ratio: float = Field(default=0.0, ge=0.0, le=1.0, alias="minMatchRatio")


@register
class KVAffinityFilter(Filter):
    type_name = "kv-affinity"
    Parameters = KVAffinityParameters
    consumes = (PREFIX_MATCH,)
    params: KVAffinityParameters

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]:
        match = state.get(PREFIX_MATCH)
        if match is None:
            return list(endpoints)
        blocks = [match.matched_blocks.get(e.name, 0) for e in endpoints]
        best = max(blocks)
        if best == 0 or best / match.total_blocks < self.params.min_match_ratio:
            return list(endpoints)
        return [e for e, b in zip(endpoints, blocks, strict=True) if b == best]
