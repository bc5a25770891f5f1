"""The Helm chart, rendered by the real Helm engine (see tests/helm/render.py), checked against
Kubernetes' own schemas and against our processes' real command lines and HTTP routes.

Custom resources (InferencePool, PodMonitoring, HTTPRoute, ...) have no schema in
kubernetes-validate; the InferencePool is checked by the EPP's own parser instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from epp.app import HEALTH_SERVICES
from epp.extproc.envoy_contract import INFERENCE_API_PATHS
from epp.k8s.pool import parse_pool
from epp.main import parse_args as epp_args
from epp.plugins.predicted_latency import PredictedLatencyParameters
from epp.scheduling.config import EndpointPickerConfig
from predictor.server import create_app as predictor_app
from predictor.settings import PredictorSettings
from tests.helm.render import (
    CHART,
    HELM_PYTHON,
    KUBERNETES_VERSION,
    NAMESPACE,
    RELEASE,
    HelmFailed,
    Rendered,
    ci_values,
    merged,
    render,
)
from trainer.server import create_app as trainer_app
from trainer.settings import TrainerSettings
from wire.webapp import parse_settings, probe_app

if not HELM_PYTHON.exists():
    # A missing install step is an error to fix, not a reason to skip the chart tests.
    raise RuntimeError(f"{HELM_PYTHON} is missing: run `make helm-env` (make test builds it)")

CI_VALUES = ci_values()
PREDICTOR_OFF = CI_VALUES["predictor-off"]
# docs/operations.md's command: --set inferencePool.modelServers.matchLabels.app=... --set provider.name=gke
# --set inferenceExtension.monitoring.gke.enabled=true --set inferenceExtension.latencyPredictor.enabled=true
# and the tokenizer from the Hub
GUIDE = CI_VALUES["guide-gke"]
ANCHOR_COUNT_ISTIO = CI_VALUES["anchor-count-istio"]


def _prediction_servers(values: dict[str, Any]) -> int:
    """The documented count: none without the predictor, else predictionServerCount when set,
    else predictionServers.count (default 1)."""
    predictor = values.get("inferenceExtension", {}).get("latencyPredictor", {})
    if not predictor.get("enabled"):
        return 0
    count = predictor.get("predictionServerCount")
    return count if count is not None else predictor.get("predictionServers", {}).get("count", 1)


CASES = {name: (values, _prediction_servers(values)) for name, values in CI_VALUES.items()}


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[Rendered, int]:
    values, servers = CASES[request.param]
    return render(values), servers


EPP = f"{RELEASE}-epp"


def _containers(rendered: Rendered) -> dict[str, dict[str, Any]]:
    pod = rendered.named("Deployment", EPP)["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in args if "=" in arg)


def test_lint_passes_and_every_object_was_accepted(case: tuple[Rendered, int]) -> None:
    rendered, _ = case
    assert not rendered.lint["Errors"], rendered.lint
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered.docs} == {
        (d["kind"], d["metadata"]["name"]) for d in rendered.posted
    }


def test_builtin_objects_validate_against_kubernetes_schemas(case: tuple[Rendered, int]) -> None:
    rendered, _ = case
    checked = 0
    for doc in rendered.docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            checked += 1
        except kubernetes_validate.SchemaNotFoundError:
            assert "." in doc["apiVersion"].split("/")[0], f"{doc['kind']} should have a schema"
    assert checked >= 6  # ServiceAccount, Role, RoleBinding, ConfigMap, Service, Deployment


def test_sidecars_match_the_prediction_server_count(case: tuple[Rendered, int]) -> None:
    rendered, servers = case
    names = list(_containers(rendered))
    expected = ["epp"] + (
        ["training-server"] + [f"prediction-server-{i + 1}" for i in range(servers)] if servers else []
    )
    assert names == expected


def test_epp_arguments_are_valid_and_wired_to_the_sidecars(
    case: tuple[Rendered, int], tmp_path: Path
) -> None:
    rendered, servers = case
    containers = _containers(rendered)
    epp = containers["epp"]
    assert epp["command"] == ["llm-epp"]
    settings, _ = epp_args(epp["args"])
    assert (settings.endpoint_source, settings.pool_name, settings.pool_namespace) == (
        "kubernetes",
        RELEASE,
        NAMESPACE,
    )
    ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert ports == {
        "grpc-ext-proc": settings.grpc_port,
        "grpc-health": settings.health_port,
        "metrics": settings.metrics_port,
    }
    predictor_ports = [urlparse(u).port for u in settings.predictor_url]
    assert len(predictor_ports) == servers
    if not servers:
        assert settings.trainer_url is None
        return
    trainer_container = containers["training-server"]
    trainer, _ = parse_settings(TrainerSettings, trainer_container["args"], "t", "")
    assert urlparse(settings.trainer_url).port == trainer.port
    trainer_ports = {p["name"]: p["containerPort"] for p in trainer_container["ports"]}
    if trainer.host == "127.0.0.1":
        # Loopback: the pod network reaches its probe-only listener, and the EPP needs no token.
        assert trainer_ports == {"train-health": trainer.health_port}
        assert trainer.auth_token_file is None and settings.trainer_token_file is None
    else:
        assert trainer_ports == {"train-health": trainer.health_port, "training": trainer.port}
        assert trainer.auth_token_file is not None and settings.trainer_token_file == trainer.auth_token_file
    for i, port in enumerate(predictor_ports):
        sidecar = containers[f"prediction-server-{i + 1}"]
        predictor, _ = parse_settings(PredictorSettings, sidecar["args"], "p", "")
        assert predictor.port == port and predictor.host == "127.0.0.1"
        assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {
            f"pred-health-{i + 1}": predictor.health_port
        }
        if predictor.trainer_url is not None:
            assert urlparse(predictor.trainer_url).port == trainer.port
        else:  # shared volume: the trainer's model directory, mounted read-only
            mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
            assert mounts[str(predictor.model_dir)].get("readOnly") is True
            trainer_mounts = {m["mountPath"]: m["name"] for m in trainer_container["volumeMounts"]}
            assert trainer_mounts[str(trainer.model_dir)] == mounts[str(predictor.model_dir)]["name"]


def _routes(app: Any) -> set[str]:
    return {route.path for route in app.routes}


def test_probes_hit_real_endpoints_of_our_processes(case: tuple[Rendered, int], tmp_path: Path) -> None:
    rendered, servers = case
    containers = _containers(rendered)
    epp = containers["epp"]
    settings, _ = epp_args(epp["args"])
    for probe in (epp["livenessProbe"], epp["readinessProbe"]):
        assert probe["grpc"]["port"] == settings.health_port
        assert probe["grpc"]["service"] in HEALTH_SERVICES
    if not servers:
        return
    # The probes reach the probe-only listener (every interface), never the loopback API port.
    trainer_routes = _routes(probe_app(trainer_app(TrainerSettings(model_dir=tmp_path / "models"))))
    predictor_routes = _routes(probe_app(predictor_app(PredictorSettings(trainer_url="http://127.0.0.1:1"))))
    for name, container in containers.items():
        if name == "epp":
            continue
        is_trainer = name == "training-server"
        routes = trainer_routes if is_trainer else predictor_routes
        model = TrainerSettings if is_trainer else PredictorSettings
        sidecar, _ = parse_settings(model, container["args"], name, "")
        assert sidecar.health_port is not None and sidecar.health_port != sidecar.port
        for probe in (container["livenessProbe"], container["readinessProbe"]):
            assert probe["httpGet"]["path"] in routes, (name, probe)
            assert probe["httpGet"]["port"] == sidecar.health_port


def test_config_map_holds_a_valid_endpoint_picker_config(case: tuple[Rendered, int]) -> None:
    rendered, servers = case
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    config_map = rendered.named("ConfigMap", f"{EPP}-config")
    name = Path(settings.config).name
    config = EndpointPickerConfig.model_validate(yaml.safe_load(config_map["data"][name]))
    plugin_types = {p.type for p in config.plugins}
    assert ("predicted-latency-producer" in plugin_types) == bool(servers)


@pytest.mark.parametrize("name", list(CI_VALUES))
def test_inference_pool_points_at_the_epp_service(name: str) -> None:
    values = CI_VALUES[name]
    rendered = render(values)
    pool_obj = rendered.one("InferencePool")
    assert pool_obj["metadata"]["name"] == RELEASE
    pool = parse_pool(pool_obj)
    assert pool.match_labels == values["inferencePool"]["modelServers"]["matchLabels"]
    ref = pool.endpointPickerRef
    assert ref is not None and ref.failureMode == "FailOpen"
    service = rendered.named("Service", EPP)
    assert ref.name == EPP
    assert ref.port is not None
    assert ref.port.number in [p["port"] for p in service["spec"]["ports"]]
    pod_labels = rendered.named("Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app"] == f"{RELEASE}-epp"  # kubectl get pods -l app=NAME-epp
    assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_provider_and_monitoring_objects() -> None:
    guide = render(GUIDE)
    assert {d["kind"] for d in guide.docs} >= {"HealthCheckPolicy", "GCPBackendPolicy", "PodMonitoring"}
    monitor = guide.one("PodMonitoring")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app": f"{RELEASE}-epp"}
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    for kind in ("HealthCheckPolicy", "GCPBackendPolicy"):
        assert guide.one(kind)["spec"]["targetRef"] == {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": RELEASE,
        }
    istio = render(ANCHOR_COUNT_ISTIO)
    assert istio.one("DestinationRule")["spec"]["host"] == f"{RELEASE}-epp.{NAMESPACE}.svc.cluster.local"
    assert istio.one("ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    route = istio.one("HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert _route_paths(route) == list(INFERENCE_API_PATHS)
    assert {o["metadata"]["name"]: o["spec"]["priority"] for o in istio.of_kind("InferenceObjective")} == {
        "batch": -1,
        "chat": 10,
    }
    rules = istio.one("Role")["rules"]
    assert any("leases" in r["resources"] for r in rules)
    assert "--ha-enable-leader-election" in _containers(istio)["epp"]["args"]
    assert not {"HealthCheckPolicy", "DestinationRule", "PodMonitoring"} & {
        d["kind"] for d in render(PREDICTOR_OFF).docs
    }


def _route_paths(route: dict[str, Any]) -> list[str]:
    [rule] = route["spec"]["rules"]
    assert {m["path"]["type"] for m in rule["matches"]} == {"Exact"}
    return [m["path"]["value"] for m in rule["matches"]]


def test_http_route_matches_only_the_inference_api_paths_the_local_gateway_routes() -> None:
    extra = merged(ANCHOR_COUNT_ISTIO, {"httpRoute": {"extraPaths": ["/v1/embeddings", "/tokenize"]}})
    route = render(extra).one("HTTPRoute")
    assert _route_paths(route) == [*INFERENCE_API_PATHS, "/v1/embeddings", "/tokenize"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": RELEASE}
    ]


def _tokenizer(**tokenizer: Any) -> dict[str, Any]:
    """PREDICTOR_OFF with its tokenizer values replaced by ``tokenizer``."""
    return {**PREDICTOR_OFF, "inferenceExtension": {"tokenizer": tokenizer}}


BAD_VALUES = {
    "no-selector": (
        {**PREDICTOR_OFF, "inferencePool": {}},
        "inferencePool.modelServers.matchLabels is required",
    ),
    "bad-provider": (merged(PREDICTOR_OFF, {"provider": {"name": "aws"}}), "provider.name"),
    "zero-servers": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"latencyPredictor": {"predictionServerCount": 0}}}),
        "predictionServerCount",
    ),
    "bad-failure-mode": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"failureMode": "FailSometimes"}}),
        "failureMode",
    ),
    "bad-port": (merged(PREDICTOR_OFF, {"inferenceExtension": {"extProcPort": 70000}}), "extProcPort"),
    "no-tokenizer": (
        _tokenizer(source=""),
        r"inferenceExtension.tokenizer.source is required: the EPP needs the served model's tokenizer",
    ),
    "bad-tokenizer-source": (_tokenizer(source="s3"), "source"),
    "config-map-without-name": (_tokenizer(source="configMap"), "tokenizer.configMap.name is required"),
    "secret-without-name": (_tokenizer(source="secret"), "tokenizer.secret.name is required"),
    "volume-without-spec": (_tokenizer(source="volume"), "tokenizer.volume.spec is required"),
    "image-without-path": (
        _tokenizer(source="image", image={"repository": "models/llama"}),
        "tokenizer.image.path is required",
    ),
    "hub-without-repo": (_tokenizer(source="hub"), "tokenizer.hub.repo is required"),
    "replicas-without-sync-or-leader-election": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"replicas": 2}}),
        "/inferenceExtension/sync/enabled': value must be true",
    ),
    "leader-election-with-sync": (
        merged(
            PREDICTOR_OFF,
            {"inferenceExtension": {"leaderElection": {"enabled": True}, "sync": {"enabled": True}}},
        ),
        "/inferenceExtension/sync/enabled': value must be false",
    ),
    "sync-token-without-secret": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"sync": {"enabled": True, "auth": {"type": "token"}}}}),
        "sync/auth/secretName",
    ),
    "sync-http-url": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"sync": {"enabled": True, "natsUrl": "http://nats"}}}),
        "sync/natsUrl",
    ),
    "sync-flag-outside-sync": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"sync": {"flags": {"grpc-port": 1}}}}),
        r"'grpc-port' does not match pattern '\^sync-",
    ),
    "relative-route-path": (
        merged(PREDICTOR_OFF, {"httpRoute": {"enabled": True, "extraPaths": ["v1/embeddings"]}}),
        "extraPaths",
    ),
}


@pytest.mark.parametrize(("values", "message"), BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_bad_values_fail_at_install(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        render(values)


def test_schema_accepts_the_documented_examples() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(defaults, schema)


def test_shipped_configs_are_the_epps_own() -> None:
    for link in (CHART / "configs").iterdir():
        assert link.is_symlink(), f"{link.name} must link to epp/configs, not copy it"
        assert link.resolve().parent == (CHART.parents[1] / "epp" / "configs").resolve()


def test_the_epp_meters_every_chunk_unless_the_gateway_is_said_to_send_its_access_log() -> None:
    """Managed gateways may not send an access log to the EPP: full metering is the default."""
    assert epp_args(_containers(render(GUIDE))["epp"]["args"])[0].response_metering == "full"
    extension = {**GUIDE["inferenceExtension"], "responseMetering": "first-token"}
    rendered = render({**GUIDE, "inferenceExtension": extension})
    assert epp_args(_containers(rendered)["epp"]["args"])[0].response_metering == "first-token"


def test_the_ext_authz_port_is_off_by_default_and_served_and_reachable_when_set() -> None:
    service_ports = {p["name"] for p in render(GUIDE).named("Service", EPP)["spec"]["ports"]}
    assert "http-ext-authz" not in service_ports
    assert epp_args(_containers(render(GUIDE))["epp"]["args"])[0].ext_authz_port is None
    extension = {**GUIDE["inferenceExtension"], "extAuthzPort": 9004}
    rendered = render({**GUIDE, "inferenceExtension": extension, "networkPolicy": {"enabled": True}})
    assert epp_args(_containers(rendered)["epp"]["args"])[0].ext_authz_port == 9004
    container_ports = {p["name"]: p["containerPort"] for p in _containers(rendered)["epp"]["ports"]}
    assert container_ports["http-ext-authz"] == 9004
    service = rendered.named("Service", EPP)
    assert {
        "name": "http-ext-authz",
        "port": 9004,
        "targetPort": "http-ext-authz",
        "protocol": "TCP",
    } in service["spec"]["ports"]
    gateway_rule = rendered.named("NetworkPolicy", EPP)["spec"]["ingress"][0]
    assert {"port": "http-ext-authz", "protocol": "TCP"} in gateway_rule["ports"]


def test_an_endpoint_class_label_reaches_the_latency_producer() -> None:
    label = "cloud.google.com/gke-accelerator"
    rendered = render(
        merged(GUIDE, {"inferenceExtension": {"latencyPredictor": {"endpointClassLabel": label}}})
    )
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    text = rendered.named("ConfigMap", f"{EPP}-config")["data"][Path(settings.config).name]
    config = EndpointPickerConfig.model_validate(yaml.safe_load(text))
    [producer] = [p for p in config.plugins if p.type == "predicted-latency-producer"]
    assert PredictedLatencyParameters.model_validate(producer.parameters).endpoint_class_label == label
    without = render(GUIDE)
    assert (
        text.replace(f'    endpointClassLabel: "{label}"\n', "")
        == without.named("ConfigMap", f"{EPP}-config")["data"][Path(settings.config).name]
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"pluginsCustomConfig": {"custom.yaml": "plugins: []"}}, "set endpointClassLabel in its"),
        ({"latencyPredictor": {"enabled": False}}, "has no predicted-latency-producer"),
    ],
)
def test_an_endpoint_class_label_where_no_shipped_producer_takes_it_is_refused(
    override: dict[str, Any], message: str
) -> None:
    values = merged(
        GUIDE, {"inferenceExtension": {"latencyPredictor": {"endpointClassLabel": "accelerator"}}}
    )
    with pytest.raises(HelmFailed, match=message):
        render(merged(values, {"inferenceExtension": override}))


def test_our_config_ships_in_the_chart_and_needs_the_predictor() -> None:
    ours = {"inferenceExtension": {"pluginsConfigFile": "predicted-latency-token-load"}}
    rendered = render(merged(GUIDE, ours))
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    name = Path(settings.config).name
    assert name == "predicted-latency-token-load.yaml"
    config = EndpointPickerConfig.model_validate(
        yaml.safe_load(rendered.named("ConfigMap", f"{EPP}-config")["data"][name])
    )
    assert {"predicted-latency-producer", "endpoint-speed-producer"} <= {p.type for p in config.plugins}
    off = {"inferenceExtension": {"latencyPredictor": {"enabled": False}}}
    for shipped in ("predicted-latency", "predicted-latency-token-load"):
        chosen = {"inferenceExtension": {"pluginsConfigFile": shipped}}
        with pytest.raises(HelmFailed, match=f'"{shipped}.yaml" predicts latency: set inferenceExtension'):
            render(merged(merged(GUIDE, off), chosen))
