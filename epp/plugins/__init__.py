"""Plugin implementations. Importing this package registers every plugin type."""

from epp.plugins import (  # noqa: F401
    kv_cache_utilization_scorer,
    latency_scorer,
    latency_slo_admitter,
    pickers,
    precise_prefix_cache,
    predicted_latency,
    prefix_affinity_filter,
    prefix_cache,
    queue_scorer,
    slo_headroom_tier_filter,
    token_load,
)
