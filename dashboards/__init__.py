"""The chart's dashboards, generated from one list of panels (``panels``): Grafana's
(``grafana``, with grafanalib) and Google Cloud Monitoring's (``cloud_monitoring``), written
into the chart by ``python -m dashboards.write_dashboards``. Development tooling: nothing of the
EPP imports it."""
