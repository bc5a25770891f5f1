"""The chart's Grafana dashboard ConfigMap and PrometheusRule, rendered by the real Helm engine."""

from __future__ import annotations

import json

import kubernetes_validate
import yaml

from dashboards.write_dashboards import CHART_FILES, GRAFANA_FILE
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


def test_monitors_scrape_the_epp_and_every_latency_sidecars_probe_listener() -> None:
    monitoring = {"gke": {"enabled": True}, "prometheus": {"enabled": True}}
    rendered = render(merged(BASE, {"inferenceExtension": {"monitoring": monitoring}}))
    [pod] = [
        d["spec"]["template"]["spec"]
        for d in rendered.of_kind("Deployment")
        if d["metadata"]["name"] == f"{RELEASE}-epp"
    ]
    containers = {c["name"]: c for c in pod["containers"]}
    sidecars = [name for name in containers if name != "epp"]
    assert len(sidecars) >= 2  # the trainer and at least one predictor
    # Each sidecar's listener on its --health-port, which serves its /metrics beside the probes.
    probe_ports = {}
    for name in sidecars:
        port = int(next(a for a in containers[name]["args"] if a.startswith("--health-port=")).split("=")[1])
        [named] = [p["name"] for p in containers[name]["ports"] if p["containerPort"] == port]
        probe_ports[named] = port
    expected = ["metrics", *sorted(probe_ports, key=probe_ports.get)]

    pod_monitoring = rendered.one("PodMonitoring")
    assert [e["port"] for e in pod_monitoring["spec"]["endpoints"]] == expected
    assert {e["path"] for e in pod_monitoring["spec"]["endpoints"]} == {"/metrics"}
    # The ServiceMonitor scrapes the Service's ports, which map onto those container ports.
    service_monitor = rendered.one("ServiceMonitor")
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == expected
    [service] = [s for s in rendered.of_kind("Service") if s["metadata"]["name"] == f"{RELEASE}-epp"]
    kubernetes_validate.validate(service, "1.33", strict=True)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert all(ports[name] == (port, name) for name, port in probe_ports.items())


def test_without_the_latency_predictor_the_monitors_scrape_the_epp_only() -> None:
    values = merged(
        BASE,
        {
            "inferenceExtension": {
                "latencyPredictor": {"enabled": False},
                "monitoring": {"gke": {"enabled": True}, "prometheus": {"enabled": True}},
            }
        },
    )
    rendered = render(values)
    for kind in ("PodMonitoring", "ServiceMonitor"):
        assert [e["port"] for e in rendered.one(kind)["spec"]["endpoints"]] == ["metrics"]
