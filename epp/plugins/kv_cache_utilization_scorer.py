"""``kv-cache-utilization-scorer``: prefers endpoints with more free KV cache.

==========  =========  ==================================================================
parameter   default    meaning
==========  =========  ==================================================================
measure     percent    percent: score = 1 − ``vllm:kv_cache_usage_perc``, the free share
                       of each endpoint's own cache (the GIE scorer). blocks: each
                       endpoint's free blocks over the most free blocks any candidate has
==========  =========  ==================================================================

``blocks`` is for pools whose engines differ in KV size: an engine with 8,000 blocks at 50%
holds 4,000 free blocks, one with 29,000 at 50% holds 14,500, and percentages call them equal.
Free blocks are ``(1 − usage) × num_gpu_blocks``, the size each engine reports in
``vllm:cache_config_info``; while any candidate's size is unknown (not yet scraped, or an engine
that does not report it) the candidates are scored by percent. On a pool of one KV size the two
give the same scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from epp.scheduling.framework import CycleState, PluginParameters, Scorer
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class KVCacheUtilizationParameters(PluginParameters):
    measure: Literal["percent", "blocks"] = "percent"


def free_kv_scores(endpoints: Sequence[EndpointState], measure: Literal["percent", "blocks"]) -> list[float]:
    """Each endpoint's free KV cache as a score in [0, 1], by ``measure`` (see the module)."""
    free = [min(1.0, max(0.0, 1.0 - e.metrics.kv_cache_usage)) for e in endpoints]
    if measure == "percent":
        return free
    sizes = [e.metrics.num_gpu_blocks for e in endpoints]
    if any(size is None for size in sizes):
        return free
    blocks = [share * size for share, size in zip(free, sizes, strict=True)]  # type: ignore[operator]
    most = max(blocks)
    return [b / most for b in blocks] if most > 0 else free


@register
class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"
    Parameters = KVCacheUtilizationParameters
    params: KVCacheUtilizationParameters

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return free_kv_scores(endpoints, self.params.measure)
