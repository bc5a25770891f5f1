"""The chart's active-active EPPs (inferenceExtension.sync): the EPP's own flag parser accepts their
sync arguments and reads the NATS credentials from the Secret's env vars, the NATS the chart
deploys runs in the real nats-server with the chart's config and refuses clients without the
Secret's credentials, and the pod's grace period covers the EPP's drain."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import pytest

from epp.main import parse_args as epp_args
from epp.settings import EppSettings
from epp.sync.nats_auth import SYNC_PASSWORD_ENV, SYNC_TOKEN_ENV, connect_options
from sim.nats_server import nats_server_binary, speaks_nats
from sim.processes import free_port, spawn, wait_until
from tests.helm.render import NAMESPACE, RELEASE, Rendered, ci_values, merged, render

EPP = f"{RELEASE}-epp"
NATS = f"{RELEASE}-nats"
DEPLOYED = ci_values()["active-active"]
EXTERNAL = ci_values()["active-active-external-nats"]


def _epp_container(rendered: Rendered) -> dict[str, Any]:
    [epp] = rendered.named("Deployment", EPP)["spec"]["template"]["spec"]["containers"][:1]
    return epp


def _env(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])}


def _settings(rendered: Rendered) -> EppSettings:
    settings, _ = epp_args(_epp_container(rendered)["args"])
    return settings


def test_deployed_nats_is_the_epps_sync_url_with_the_secrets_token() -> None:
    rendered = render(DEPLOYED)
    deployment = rendered.named("Deployment", EPP)
    assert deployment["spec"]["replicas"] == 3
    settings = _settings(rendered)
    service = rendered.named("Service", NATS)
    [client] = [p for p in service["spec"]["ports"] if p["name"] == "client"]
    assert settings.sync_nats_url == [f"nats://{NATS}.{NAMESPACE}.svc:{client['port']}"]
    assert settings.sync_peer_timeout_s == 5 and not settings.ha_enable_leader_election
    secret_ref = {"name": "epp-nats", "key": "token"}
    assert _env(_epp_container(rendered)) == {SYNC_TOKEN_ENV: secret_ref}
    assert connect_options(settings, {SYNC_TOKEN_ENV: "s3cret"}) == {"token": "s3cret"}
    nats_pod = rendered.named("Deployment", NATS)["spec"]["template"]
    assert all(nats_pod["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
    [server] = nats_pod["spec"]["containers"]
    assert server["image"] == "nats:2.15.1"
    assert _env(server) == {"NATS_TOKEN": secret_ref}
    # Drain: the EPP's grace and drain, and the pod's grace period that covers both.
    assert (settings.shutdown_grace_s, settings.shutdown_drain_s) == (3, 20)
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 3 + 20 + 5


def test_only_the_epp_pods_may_reach_the_deployed_nats() -> None:
    rendered = render(DEPLOYED)
    policy = rendered.named("NetworkPolicy", NATS)["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app": NATS}
    client_rule, monitor_rule = policy["ingress"]
    epp_labels = rendered.named("Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    [source] = client_rule["from"]
    assert all(epp_labels.get(k) == v for k, v in source["podSelector"]["matchLabels"].items())
    assert client_rule["ports"] == [{"port": "client", "protocol": "TCP"}]
    # Its monitoring port: the monitoring peers only (tests/helm/test_gateway_exposure.py).
    assert monitor_rule["from"] and monitor_rule["ports"] == [{"port": "monitor", "protocol": "TCP"}]


def test_a_headless_service_lists_every_active_active_replica() -> None:
    rendered = render(DEPLOYED)
    headless = rendered.named("Service", f"{EPP}-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == rendered.named("Service", EPP)["spec"]["selector"]
    assert {p["name"] for p in headless["ports"]} == {"grpc-ext-proc", "grpc-health"}
    single = render(ci_values()["predictor-off"])
    assert [s["metadata"]["name"] for s in single.of_kind("Service")] == [EPP]
    assert "--sync-nats-url" not in " ".join(_epp_container(single)["args"])


def test_an_existing_nats_gets_the_user_and_the_secrets_password_and_no_nats_is_deployed() -> None:
    rendered = render(EXTERNAL)
    settings = _settings(rendered)
    assert settings.sync_nats_url == [
        "nats://nats-0.nats.messaging.svc:4222",
        "nats://nats-1.nats.messaging.svc:4222",
    ]
    assert settings.sync_nats_user == "llm-epp"
    assert _env(_epp_container(rendered)) == {SYNC_PASSWORD_ENV: {"name": "epp-nats", "key": "password"}}
    assert connect_options(settings, {SYNC_PASSWORD_ENV: "pw"}) == {"user": "llm-epp", "password": "pw"}
    assert not [d for d in rendered.docs if d["metadata"]["name"].startswith(NATS)]


AUTH = {
    "token": ({"type": "token", "secretName": "s"}, {"NATS_TOKEN": "s3cret"}, {"token": "s3cret"}),
    "userPassword": (
        {"type": "userPassword", "secretName": "s", "user": "llm-epp"},
        {"NATS_PASSWORD": "pw"},
        {"user": "llm-epp", "password": "pw"},
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("auth", list(AUTH))
def test_the_charts_nats_config_runs_in_nats_server_and_refuses_clients_without_the_secret(
    auth: str, tmp_path: Path
) -> None:
    auth_values, secret_env, credentials = AUTH[auth]
    port, monitor = free_port(), free_port()
    sync = {"auth": auth_values, "nats": {"port": port, "monitorPort": monitor}}
    values = merged(DEPLOYED, {"inferenceExtension": {"sync": sync}})
    config_map = render(values).named("ConfigMap", f"{NATS}-config")
    (tmp_path / "nats.conf").write_text(config_map["data"]["nats.conf"])
    argv = [nats_server_binary(), "--config", str(tmp_path / "nats.conf")]
    server = spawn("nats", argv, tmp_path, secret_env)
    try:
        wait_until(server, lambda: speaks_nats(port), timeout=30)
        asyncio.run(_admits_only(f"nats://127.0.0.1:{port}", credentials))
    finally:
        server.stop()


async def _admits_only(url: str, credentials: dict[str, str]) -> None:
    client = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **credentials)
    await client.close()
    with pytest.raises(nats.errors.Error):
        await nats.connect(url, allow_reconnect=False, connect_timeout=5)
