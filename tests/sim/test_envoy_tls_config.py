"""The gateway's TLS to the EPP in the generated bootstrap, validated by the real Envoy binary
(the handshakes themselves: tests/integration/test_ext_proc_tls.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.certs import write_local_pki
from sim.envoy_config import EppTls, gateway_bootstrap, with_epp_replicas, write_cluster_endpoints
from tests.epp.envoy_check import validate_bootstrap


@pytest.fixture
def tls(tmp_path: Path) -> EppTls:
    pki = write_local_pki(tmp_path / "tls")
    return EppTls(pki.ca_file, pki.server_name, pki.client_cert_file, pki.client_key_file)


def _bootstrap(tmp_path: Path, tls: EppTls) -> dict:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    return gateway_bootstrap(
        listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints, epp_tls=tls
    )


def _epp_cluster(bootstrap: dict) -> dict:
    [cluster] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp"]
    return cluster


def test_the_epp_cluster_verifies_the_epps_certificate_and_name(tmp_path: Path, tls: EppTls) -> None:
    bootstrap = _bootstrap(tmp_path, tls)
    validate_bootstrap(tmp_path, bootstrap)
    socket = _epp_cluster(bootstrap)["transport_socket"]["typed_config"]
    assert socket["sni"] == tls.server_name
    context = socket["common_tls_context"]
    validation = context["validation_context"]
    assert validation["trusted_ca"] == {"filename": str(tls.ca_file)}
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
    ]
    assert context["tls_certificates"][0]["certificate_chain"] == {"filename": str(tls.client_cert_file)}
    assert context["alpn_protocols"] == ["h2"]


def test_without_a_client_certificate_the_gateway_presents_none(tmp_path: Path, tls: EppTls) -> None:
    tls = EppTls(tls.ca_file, tls.server_name)
    bootstrap = _bootstrap(tmp_path, tls)
    validate_bootstrap(tmp_path, bootstrap)
    assert (
        "tls_certificates"
        not in _epp_cluster(bootstrap)["transport_socket"]["typed_config"]["common_tls_context"]
    )


def test_replicas_over_tls_are_health_checked_in_plaintext(tmp_path: Path, tls: EppTls) -> None:
    bootstrap = with_epp_replicas(
        _bootstrap(tmp_path, tls), [("127.0.0.1", 19002, 19003), ("127.0.0.1", 19012, 19013)]
    )
    validate_bootstrap(tmp_path, bootstrap)
    cluster = _epp_cluster(bootstrap)
    [check] = cluster["health_checks"]
    [match] = cluster["transport_socket_matches"]
    assert check["transport_socket_match_criteria"] == match["match"]
    assert match["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"
    assert cluster["transport_socket"]["name"] == "envoy.transport_sockets.tls"


def test_plaintext_replicas_have_no_transport_socket_match(tmp_path: Path) -> None:
    endpoints = write_cluster_endpoints(tmp_path / "eds" / "endpoints.json", [("127.0.0.1", 18100)])
    plain = gateway_bootstrap(listen_port=18081, epp_address=("127.0.0.1", 19002), endpoints_file=endpoints)
    cluster = _epp_cluster(with_epp_replicas(plain, [("127.0.0.1", 19002, 19003)]))
    assert "transport_socket_matches" not in cluster
    assert "transport_socket_match_criteria" not in cluster["health_checks"][0]
