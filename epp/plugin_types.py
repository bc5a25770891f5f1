"""Importing this module registers every plugin type an EndpointPickerConfig can name: the
scheduling plugins (``epp.plugins``) and flow control's policies and saturation detectors
(``epp.flowcontrol``)."""

from epp.flowcontrol import fairness, ordering, saturation  # noqa: F401
from epp.plugins import (  # noqa: F401
    candidate_sampler,
    endpoint_speed,
    kv_affinity,
    kv_cache_utilization_scorer,
    latency_scorer,
    latency_slo_admitter,
    load_balancing,
    pickers,
    precise_prefix_cache,
    predicted_latency,
    prefix_affinity_filter,
    prefix_cache,
    queue_scorer,
    session_affinity,
    slo_headroom_tier_filter,
    token_load,
    token_load_scorer,
)
