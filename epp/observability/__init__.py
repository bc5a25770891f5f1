"""What operators see of the EPP: dashboard definitions (Grafana, Cloud Monitoring), the live
``/dashboard`` page and its data."""
