"""The chart's Grafana dashboard ConfigMap and PrometheusRule, rendered by the real Helm engine."""

from __future__ import annotations

import json

import kubernetes_validate
import yaml

from epp.observability.write_dashboards import CHART_FILES, GRAFANA_FILE
from tests.helm.render import RELEASE, ci_values, merged, render

BASE = ci_values()["three-servers"]
ENABLED = merged(
    BASE,
    {
        "inferenceExtension": {
            "monitoring": {
                "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
                "alerts": {"enabled": True, "extraLabels": {"release": "kube-prometheus-stack"}},
            }
        }
    },
)


def test_dashboard_configmap_carries_the_generated_json_and_the_sidecar_label() -> None:
    rendered = render(ENABLED)
    [configmap] = [
        d for d in rendered.of_kind("ConfigMap") if d["metadata"]["name"] == f"{RELEASE}-epp-dashboard"
    ]
    kubernetes_validate.validate(configmap, "1.33", strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["llm-epp.json"]) == json.loads(
        (CHART_FILES / GRAFANA_FILE).read_text()
    )
    assert not rendered.lint["Errors"], rendered.lint


def test_prometheus_rule_ships_the_tested_rule_file() -> None:
    rule = render(ENABLED).one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())


def test_neither_is_rendered_by_default() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render(BASE).docs}
    assert ("ConfigMap", f"{RELEASE}-epp-dashboard") not in kinds
    assert not any(kind == "PrometheusRule" for kind, _ in kinds)
