"""``latency-slo-admitter``: shed sheddable requests that no endpoint can serve in their SLO.

Applies only to requests with priority below 0 that carry an SLO. Such a request is admitted
when some endpoint is predicted to meet its SLO, or is idle, or has almost no KV cache in use
(< 2%: predictions for it are least trustworthy and it has room). Otherwise it is refused with
429 and ``Retry-After``, so the client backs off instead of adding to an overload. Without
predictions (predictor down or warming up) nothing is shed: the admitter cannot judge.

=================  =======  ===========================================================
parameter          default  meaning
=================  =======  ===========================================================
retryAfterSeconds  1        value of the ``Retry-After`` header on a refusal
=================  =======  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.errors import RequestShed
from epp.scheduling.framework import Admitter, CycleState, PluginParameters
from epp.scheduling.predictions import LATENCY_PREDICTIONS
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest

NEARLY_EMPTY_KV = 0.02


class LatencySloAdmitterParameters(PluginParameters):
    retry_after_seconds: int = Field(default=1, ge=1, le=3600, alias="retryAfterSeconds")


@register
class LatencySloAdmitter(Admitter):
    type_name = "latency-slo-admitter"
    Parameters = LatencySloAdmitterParameters
    consumes = (LATENCY_PREDICTIONS,)
    params: LatencySloAdmitterParameters

    def admit(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None:
        if request.priority >= 0:
            return
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is None or not predictions.has_slo:
            return
        for e in endpoints:
            p = predictions.by_endpoint.get(e.name)
            if p is not None and p.meets_slo:
                return
            m = e.metrics
            if (m.running == 0 and m.waiting == 0) or m.kv_cache_usage < NEARLY_EMPTY_KV:
                return
        raise RequestShed(
            "no endpoint is predicted to meet this sheddable request's latency objective",
            retry_after_s=self.params.retry_after_seconds,
        )
