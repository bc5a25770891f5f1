"""``kv-cache-utilization-scorer``: prefers endpoints with more free KV cache.

Score = 1 − ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1]). No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


def free_kv_scores(endpoints: Sequence[EndpointState]) -> list[float]:
    """Each endpoint's free share of its KV cache, in [0, 1]."""
    return [min(1.0, max(0.0, 1.0 - e.metrics.kv_cache_usage)) for e in endpoints]


@register
class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return free_kv_scores(endpoints)
