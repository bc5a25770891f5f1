"""Flow control: requests wait in the EPP, by priority band and fairly across tenants, while the
pool is saturated (off unless the EndpointPickerConfig has a ``flowControl`` section).

The core is pure (no I/O, no clock: every call takes ``now``): ``types`` (queued requests and
bookings), ``fairness`` (which flow of a band goes next), ``ordering`` (which request of a
flow goes next), ``saturation`` (whether the pool has room), ``controller`` (the queues,
limits and dispatch loop), ``peers`` (synced peer replicas' token load, when replicas share it),
``prefix`` (where a held request's prompt is likely cached, for the per-endpoint prefill rules).
``config`` builds it from the EndpointPickerConfig; ``gate`` is the asyncio adapter the live EPP
awaits; ``metrics`` exports it to Prometheus.
"""
