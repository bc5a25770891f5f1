"""Plugin implementations. Importing this package registers every plugin type."""

from epp.plugins import (  # noqa: F401
    kv_cache_utilization_scorer,
    pickers,
    prefix_cache,
    queue_scorer,
)
