"""``queue-scorer``: prefers endpoints with fewer requests waiting in the engine's queue.

Score = (max − q) / (max − min) over the candidates, q = ``vllm:num_requests_waiting``;
every candidate scores 1.0 when all queues are equal. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """Map the smallest value to 1 and the largest to 0, linearly; all 1.0 if they are equal."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


@register
class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return min_max_inverse([e.metrics.waiting for e in endpoints])
