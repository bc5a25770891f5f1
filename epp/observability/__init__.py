"""What operators see of the EPP: dashboard definitions (Grafana, Cloud Monitoring), the live
``/dashboard`` page and its data, the per-request decision trace (``decision``) and its
OpenTelemetry spans (``tracing``)."""
