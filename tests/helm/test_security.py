"""The chart's security objects and wiring: the EPP pod's NetworkPolicy, the sidecars' loopback
binding and token, ext_proc TLS (Secret, cert-manager Certificate, the providers' verifying
objects) and NATS TLS. Rendered by the real Helm engine (tests/helm/render.py); built-in kinds
validated against Kubernetes' schemas; arguments parsed by our processes' own flag parsers."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import kubernetes_validate
import nats
import pytest

from epp.main import parse_args as epp_args
from epp.sync.nats_auth import connect_options
from sim.certs import write_local_pki
from sim.nats_server import nats_server_binary, speaks_nats
from sim.processes import free_port, spawn, wait_until
from tests.helm.render import (
    KUBERNETES_VERSION,
    NAMESPACE,
    RELEASE,
    HelmFailed,
    Rendered,
    ci_values,
    merged,
    render,
)
from trainer.settings import TrainerSettings
from wire.webapp import parse_settings

EPP = f"{RELEASE}-epp"
NATS = f"{RELEASE}-nats"
CI = ci_values()
SECURE = CI["secure-istio"]
TLS_GKE = CI["tls-gke"]
PREDICTOR_OFF = CI["predictor-off"]
SERVER_NAME = f"{EPP}.{NAMESPACE}.svc"


def _pod(rendered: Rendered) -> dict[str, Any]:
    return rendered.named("Deployment", EPP)["spec"]["template"]


def _containers(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in _pod(rendered)["spec"]["containers"]}


def _secret_mounts(rendered: Rendered, container: str) -> dict[str, str]:
    """Mount path → Secret name, of ``container``'s Secret volumes."""
    volumes = {
        v["name"]: v["secret"]["secretName"] for v in _pod(rendered)["spec"]["volumes"] if "secret" in v
    }
    mounts = _containers(rendered)[container]["volumeMounts"]
    return {m["mountPath"]: volumes[m["name"]] for m in mounts if m["name"] in volumes}


def _secret_of(rendered: Rendered, container: str, path: Path | None) -> str:
    """The Secret whose mount holds ``path`` in ``container``."""
    assert path is not None
    [secret] = [s for mount, s in _secret_mounts(rendered, container).items() if path.parent == Path(mount)]
    return secret


def _policy(rendered: Rendered) -> dict[str, Any]:
    return rendered.named("NetworkPolicy", EPP)["spec"]


def _rules_by_port(policy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["port"]: rule for rule in policy["ingress"] for p in rule["ports"]}


def _health_port(container: dict[str, Any]) -> int:
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
    return int(flags["health-port"])


def _bound_ports(name: str, container: dict[str, Any]) -> set[int]:
    """The ports ``container`` listens on: its listed ports and, for a sidecar, its flags' (the
    loopback API port is listed nowhere else)."""
    ports = {p["containerPort"] for p in container.get("ports", [])}
    if name != "epp":
        flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
        ports |= {int(flags[f]) for f in ("port", "health-port") if f in flags}
    return ports


@pytest.mark.parametrize("case", list(CI))
def test_no_two_listeners_in_the_pod_share_a_port(case: str) -> None:
    bound = [_bound_ports(name, c) for name, c in _containers(render(CI[case])).items()]
    assert sum(map(len, bound)) == len(set().union(*bound))


@pytest.mark.parametrize("case", list(CI))
def test_the_network_policy_is_on_by_default_and_admits_only_the_epps_serving_ports(case: str) -> None:
    rendered = render(CI[case])
    policy = rendered.named("NetworkPolicy", EPP)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    labels = _pod(rendered)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in spec["podSelector"]["matchLabels"].items())
    containers = _containers(rendered)
    epp_ports = {p["name"] for p in containers["epp"]["ports"]}
    trainer = containers.get("training-server")
    exposed = {p["name"] for p in trainer["ports"] if p["name"] == "training"} if trainer else set()
    # The sidecars' probe listeners (they serve their /metrics too), each on its own port.
    probes = {
        p["name"]
        for name, c in containers.items()
        if name != "epp"
        for p in c.get("ports", [])
        if p["containerPort"] == _health_port(c)
    }
    rules = _rules_by_port(spec)
    # Only named ports the pod has, and only these: no sidecar API port unless it is exposed.
    assert set(rules) == {"grpc-ext-proc", "grpc-health", "metrics"} | exposed | probes
    assert set(rules) <= epp_ports | exposed | probes
    # The probe listeners are open to monitoring only, as the EPP's /metrics.
    assert all(rules[name] is rules["metrics"] for name in probes)
    assert len(probes) == (
        1 + len([n for n in containers if n.startswith("prediction-server")]) if trainer else 0
    )


def test_by_default_only_the_named_gateways_pods_open_ext_proc_and_monitoring_scrapes() -> None:
    rules = _rules_by_port(_policy(render(PREDICTOR_OFF)))
    gateway = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
    assert rules["grpc-ext-proc"] is rules["grpc-health"]
    # One peer: the label AND the gateway's namespace (the release's by default).
    namespace = {"kubernetes.io/metadata.name": NAMESPACE}
    assert rules["grpc-ext-proc"]["from"] == [
        {"namespaceSelector": {"matchLabels": namespace}, "podSelector": {"matchLabels": gateway}}
    ]
    [monitoring] = rules["metrics"]["from"]
    [expression] = monitoring["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["gmp-system", "monitoring"]


def test_on_gke_ext_proc_is_open_to_the_proxy_subnet_given_or_else_to_any_source() -> None:
    assert "from" not in _rules_by_port(_policy(render(CI["guide-gke"])))["grpc-ext-proc"]
    assert _rules_by_port(_policy(render(TLS_GKE)))["grpc-ext-proc"]["from"] == [
        {"ipBlock": {"cidr": "10.129.0.0/23"}}
    ]


def test_network_policy_values_open_it_further_or_turn_it_off() -> None:
    extra = {"from": [{"podSelector": {"matchLabels": {"app": "debug"}}}], "ports": [{"port": 9999}]}
    opened = render(merged(PREDICTOR_OFF, {"networkPolicy": {"extraIngress": [extra], "monitoringFrom": []}}))
    policy = opened.named("NetworkPolicy", EPP)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    assert policy["spec"]["ingress"][-1] == extra
    assert "metrics" not in _rules_by_port(policy["spec"])  # []: no one scrapes
    off = render(merged(PREDICTOR_OFF, {"networkPolicy": {"enabled": False}}))
    assert not off.of_kind("NetworkPolicy")


def test_an_exposed_trainer_binds_every_interface_and_reads_the_token_the_epp_sends() -> None:
    rendered = render(SECURE)
    containers = _containers(rendered)
    trainer, _ = parse_settings(TrainerSettings, containers["training-server"]["args"], "t", "")
    epp, _ = epp_args(containers["epp"]["args"])
    assert trainer.host == "0.0.0.0"
    assert trainer.auth_token_file == epp.trainer_token_file
    assert _secret_of(rendered, "training-server", trainer.auth_token_file) == "trainer-token"
    assert _secret_of(rendered, "epp", epp.trainer_token_file) == "trainer-token"
    [rule] = [
        r for r in _policy(rendered)["ingress"] if r["ports"] == [{"port": "training", "protocol": "TCP"}]
    ]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "remote-predictor"}}}]


def test_the_epp_serves_mtls_with_the_cert_managers_secret() -> None:
    rendered = render(SECURE)
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    tls = settings.grpc_tls()
    assert tls is not None and tls.client_ca_file is not None
    secret = _secret_of(rendered, "epp", tls.cert_file)
    assert {tls.cert_file.name, tls.key_file.name, tls.client_ca_file.name} == {
        "tls.crt",
        "tls.key",
        "ca.crt",
    }
    assert _secret_of(rendered, "epp", tls.client_ca_file) == secret
    certificate = rendered.one("Certificate")["spec"]
    assert certificate["secretName"] == secret
    assert (
        SERVER_NAME in certificate["dnsNames"]
        and f"{EPP}-headless.{NAMESPACE}.svc" in certificate["dnsNames"]
    )
    assert certificate["issuerRef"] == {"name": "epp-ca", "kind": "Issuer", "group": "cert-manager.io"}
    # The pod runs as 10001 with fsGroup 10001: the Secret's files (0440) are readable to it.
    assert _pod(rendered)["spec"]["securityContext"]["fsGroup"] == 10001
    # kubelet's gRPC probes stay on the plaintext health port.
    assert _containers(rendered)["epp"]["readinessProbe"]["grpc"]["port"] == settings.health_port


def test_istio_verifies_the_epps_certificate_and_presents_the_gateways_under_mtls() -> None:
    tls = render(SECURE).one("DestinationRule")["spec"]["trafficPolicy"]["tls"]
    assert tls == {
        "mode": "MUTUAL",
        "credentialName": "epp-gateway-client",
        "sni": SERVER_NAME,
        "subjectAltNames": [SERVER_NAME],
        "insecureSkipVerify": False,
    }
    server_only = merged(SECURE, {"inferenceExtension": {"tls": {"requireClientCert": False}}})
    assert render(server_only).one("DestinationRule")["spec"]["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    plaintext = render(CI["anchor-count-istio"]).one("DestinationRule")["spec"]["trafficPolicy"]["tls"]
    assert plaintext == {"mode": "DISABLE"}


def test_gke_gets_a_backend_tls_policy_on_the_ext_proc_port() -> None:
    rendered = render(TLS_GKE)
    spec = rendered.one("BackendTLSPolicy")["spec"]
    service = rendered.named("Service", EPP)
    [target] = spec["targetRefs"]
    assert (target["kind"], target["name"]) == ("Service", EPP)
    assert target["sectionName"] in {p["name"] for p in service["spec"]["ports"]}
    assert spec["validation"] == {
        "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "epp-ca"}],
        "hostname": SERVER_NAME,
    }
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    tls = settings.grpc_tls()
    assert tls is not None and tls.client_ca_file is None
    assert _secret_of(rendered, "epp", tls.cert_file) == "epp-tls"
    assert not rendered.of_kind("Certificate")
    assert not render(CI["guide-gke"]).of_kind("BackendTLSPolicy")


def test_nats_tls_wires_the_secrets_into_the_epps_and_the_charts_nats() -> None:
    rendered = render(SECURE)
    settings, _ = epp_args(_containers(rendered)["epp"]["args"])
    assert settings.sync_nats_url == [f"tls://{NATS}.{NAMESPACE}.svc:4222"]
    for path in (
        settings.sync_nats_tls_ca_file,
        settings.sync_nats_tls_cert_file,
        settings.sync_nats_tls_key_file,
    ):
        assert _secret_of(rendered, "epp", path) == "epp-nats-client-tls"
    nats_pod = rendered.named("Deployment", NATS)["spec"]["template"]["spec"]
    [volume] = [v for v in nats_pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "epp-nats-server-tls"
    assert nats_pod["securityContext"]["fsGroup"] == 10001
    assert "verify: true" in rendered.named("ConfigMap", f"{NATS}-config")["data"]["nats.conf"]


SECURE_BAD = {
    "tls-without-secret": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"tls": {"enabled": True}}}),
        "tls/secretName",
    ),
    "client-certs-without-tls": (
        merged(PREDICTOR_OFF, {"inferenceExtension": {"tls": {"requireClientCert": True}}}),
        "tls/enabled",
    ),
    "cert-manager-without-issuer": (
        merged(
            PREDICTOR_OFF,
            {"inferenceExtension": {"tls": {"enabled": True, "certManager": {"enabled": True}}}},
        ),
        "issuerRef",
    ),
    "istio-tls-without-credential": (
        merged(
            CI["anchor-count-istio"], {"inferenceExtension": {"tls": {"enabled": True, "secretName": "t"}}}
        ),
        "provider.istio.destinationRule.credentialName is required",
    ),
    "gke-tls-without-ca": (
        merged(CI["guide-gke"], {"inferenceExtension": {"tls": {"enabled": True, "secretName": "t"}}}),
        "provider.backendTLSPolicy.caConfigMapName is required",
    ),
    "exposed-trainer-without-token": (
        merged(
            CI["guide-gke"],
            {"inferenceExtension": {"latencyPredictor": {"trainingServer": {"expose": {"enabled": True}}}}},
        ),
        "tokenSecret",
    ),
    "nats-tls-without-server-secret": (
        merged(
            CI["active-active"],
            {"inferenceExtension": {"sync": {"tls": {"enabled": True, "secretName": "c"}}}},
        ),
        "sync.nats.tls.secretName is required",
    ),
}


@pytest.mark.parametrize(("values", "message"), SECURE_BAD.values(), ids=list(SECURE_BAD))
def test_incomplete_security_values_fail_at_install(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        render(values)


@pytest.mark.integration
def test_the_charts_nats_tls_config_runs_in_nats_server_and_needs_a_client_certificate(
    tmp_path: Path,
) -> None:
    """The chart's nats.conf (its Secret's files in a temporary directory) in the real
    nats-server: the EPP's own connect options, from the chart's flags, get in; a client
    without a certificate does not."""
    pki = write_local_pki(tmp_path / "pki", server_name="localhost")
    port, monitor = free_port(), free_port()
    values = merged(
        SECURE, {"inferenceExtension": {"sync": {"nats": {"port": port, "monitorPort": monitor}}}}
    )
    rendered = render(values)
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    for directory, (cert, key) in (
        (server_dir, (pki.server_cert_file, pki.server_key_file)),
        (client_dir, (pki.client_cert_file, pki.client_key_file)),
    ):
        directory.mkdir()
        (directory / "tls.crt").write_bytes(cert.read_bytes())
        (directory / "tls.key").write_bytes(key.read_bytes())
        (directory / "ca.crt").write_bytes(pki.ca_file.read_bytes())
    config = rendered.named("ConfigMap", f"{NATS}-config")["data"]["nats.conf"]
    (tmp_path / "nats.conf").write_text(config.replace("/var/run/nats/tls", str(server_dir)))
    server = spawn("nats", [nats_server_binary(), "--config", str(tmp_path / "nats.conf")], tmp_path,
                   {"NATS_TOKEN": "s3cret"})  # fmt: skip
    args = [
        a.replace("/var/run/llm-epp/nats-tls", str(client_dir)) for a in _containers(rendered)["epp"]["args"]
    ]
    settings, _ = epp_args(args)
    try:
        wait_until(server, lambda: speaks_nats(port), timeout=30)
        options = connect_options(settings, {"LLM_EPP_SYNC_NATS_TOKEN": "s3cret"})
        asyncio.run(_admits_only_with_a_certificate(f"tls://localhost:{port}", options, pki.ca_file))
    finally:
        server.stop()


async def _admits_only_with_a_certificate(url: str, options: dict[str, Any], ca_file: Path) -> None:
    client = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **options)
    await client.close()
    no_cert = ssl.create_default_context(cafile=str(ca_file))
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(url, allow_reconnect=False, connect_timeout=5, token=options["token"], tls=no_cert)
