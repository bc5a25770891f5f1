"""What the chart lets strangers at the gateway reach: decision traces (off unless the operator
turns them on, and then behind a token or source networks), the EPP's ext_proc port (the gateway's
pods, by namespace and label together), and the chart's NATS's monitoring port (the monitoring
peers only). Rendered by the real Helm engine; the EPP's arguments parsed by its own parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from epp.main import parse_args as epp_args
from epp.observability.decision import DECISION_HEADER
from epp.requestcontrol.lifecycle import ENDPOINT_HEADER
from tests.helm.render import KUBERNETES_VERSION, NAMESPACE, RELEASE, HelmFailed, ci_values, merged, render

CI = ci_values()
BASE = merged(CI["predictor-off"], {"httpRoute": {"enabled": True}})
EPP = f"{RELEASE}-epp"
NATS = f"{RELEASE}-nats"
ROOT = Path(__file__).resolve().parents[2]


def _epp_args(values: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    rendered = render(values)
    pod = rendered.named("Deployment", EPP)["spec"]["template"]
    [epp] = [c for c in pod["spec"]["containers"] if c["name"] == "epp"]
    settings, _ = epp_args(
        [a for a in epp["args"] if not a.startswith("--tokenizer-dir")] + ["--tokenizer-dir=/t"]
    )
    return settings, rendered.one("HTTPRoute")


def _trace_headers_the_epp_sets() -> set[str]:
    report = (ROOT / "epp" / "latency" / "report.py").read_text()
    return {ENDPOINT_HEADER, DECISION_HEADER, *re.findall(r'"(x-llm-epp-[a-z-]+)"', report)}


def test_by_default_no_traces_and_the_route_strips_the_header_both_ways() -> None:
    settings, route = _epp_args(BASE)
    assert settings.decision_trace_token_file is None and settings.decision_trace_from == []
    [rule] = route["spec"]["rules"]
    filters = {f["type"]: f for f in rule["filters"]}
    assert filters["RequestHeaderModifier"]["requestHeaderModifier"]["remove"] == ["x-llm-epp-debug"]
    removed = set(filters["ResponseHeaderModifier"]["responseHeaderModifier"]["remove"])
    assert removed == _trace_headers_the_epp_sets()


def test_traces_on_read_the_token_secret_and_networks_and_the_route_lets_the_header_through() -> None:
    traces = {"enabled": True, "tokenSecret": {"name": "trace-token"}, "from": ["10.8.0.0/16", "::1/128"]}
    values = merged(BASE, {"inferenceExtension": {"decisionTraces": traces}})
    settings, route = _epp_args(values)
    assert settings.decision_trace_from == ["10.8.0.0/16", "::1/128"]
    token_file = settings.decision_trace_token_file
    assert token_file is not None and token_file.name == "token"
    pod = render(values).named("Deployment", EPP)["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "decision-trace-token"]
    assert volume["secret"]["secretName"] == "trace-token"
    [epp] = [c for c in pod["containers"] if c["name"] == "epp"]
    [mount] = [m for m in epp["volumeMounts"] if m["name"] == "decision-trace-token"]
    assert Path(mount["mountPath"]) == token_file.parent
    assert "filters" not in route["spec"]["rules"][0]


def test_traces_on_without_anyone_allowed_fail_at_install() -> None:
    with pytest.raises(HelmFailed, match=r"tokenSecret\.name or from"):
        render(merged(BASE, {"inferenceExtension": {"decisionTraces": {"enabled": True}}}))


@pytest.mark.parametrize(("gateway_namespace", "expected"), [("", NAMESPACE), ("gateways", "gateways")])
def test_ext_proc_admits_the_gateways_pods_by_namespace_and_label_in_one_peer(
    gateway_namespace: str, expected: str
) -> None:
    rendered = render(merged(BASE, {"httpRoute": {"gatewayNamespace": gateway_namespace}}))
    policy = rendered.named("NetworkPolicy", EPP)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    [rule] = [
        r for r in policy["spec"]["ingress"] if {"port": "grpc-ext-proc", "protocol": "TCP"} in r["ports"]
    ]
    [peer] = rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": expected}}
    assert peer["podSelector"] == {
        "matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
    }
    parent = rendered.one("HTTPRoute")["spec"]["parentRefs"][0]
    assert parent.get("namespace", NAMESPACE) == expected


@pytest.mark.parametrize("closed", [False, True])
def test_the_charts_nats_opens_its_monitoring_port_to_the_monitoring_peers_only(closed: bool) -> None:
    values = merged(CI["active-active"], {"networkPolicy": {"monitoringFrom": []}} if closed else {})
    policy = render(values).named("NetworkPolicy", NATS)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    by_port = {p["port"]: rule for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert all("from" in rule for rule in policy["spec"]["ingress"])  # no rule open to any source
    if closed:
        assert "monitor" not in by_port
    else:
        [peer] = by_port["monitor"]["from"]
        assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["gmp-system", "monitoring"]
