"""``queue-scorer``: prefers endpoints with fewer requests waiting in the engine's queue.

Score = (max − q) / (max − min) over the candidates, q = ``vllm:num_requests_waiting``;
every candidate scores 1.0 when all queues are equal. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.registry import register
from epp.scheduling.scores import min_max_inverse
from epp.scheduling.types import EndpointState, LLMRequest


@register
class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return min_max_inverse([e.metrics.waiting for e in endpoints])
