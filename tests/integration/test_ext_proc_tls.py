"""ext_proc over TLS and mTLS, with real Envoy: the stack's EPP requires client certificates
(``tls="mtls"``) from a throwaway CA (:mod:`sim.certs`); extra gateways in front of the same EPP
trust another CA, or present no certificate.

A failed handshake is an unreachable EPP to Envoy, so FailClose answers the OpenAI-shaped 500
and FailOpen routes round-robin without the EPP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sim.certs import write_ca
from sim.envoy_admin import stat
from sim.envoy_config import EppTls, FailureMode
from sim.processes import Component, free_port, start_envoy
from sim.stack import LocalStack
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration
BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
SCHEDULED = "inference_objective_request_total"
HTTP2_SETTINGS_FRAME = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("tls"), replicas=2, sim_profile="instant", tls="mtls")
    yield s
    s.stop()


@pytest.fixture
def gateways(stack: LocalStack) -> Iterator[list[Component]]:
    started: list[Component] = []
    yield started
    for envoy in started:
        envoy.stop()


def extra_gateway(stack: LocalStack, started: list[Component], tls: EppTls, failure_mode: FailureMode) -> str:
    """Another Envoy in front of the stack's EPP, with ``tls``; its base URL."""
    port = free_port()
    name = f"envoy-{len(started)}"
    started.append(start_envoy(name, stack.gateway_config(port, tls, failure_mode), stack.workdir))
    return f"http://127.0.0.1:{port}"


def scheduled(stack: LocalStack) -> float:
    return metric_sum(stack.epp_metrics_url, SCHEDULED)


def tls_hello(stack: LocalStack, ca_file: Path, client_cert: bool) -> bytes:
    """Handshake with the EPP's ext_proc port as an HTTP/2 client would; the first 9 bytes the
    server sends (an HTTP/2 frame header) or the TLS error it ends with."""
    assert stack.pki is not None
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(stack.pki.client_cert_file, stack.pki.client_key_file)
    with (
        socket.create_connection(("127.0.0.1", stack.config.ports.epp_grpc), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=stack.pki.server_name) as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        return tls.recv(9)


def test_a_verified_handshake_routes(stack: LocalStack) -> None:
    assert stack.pki is not None
    before = scheduled(stack)
    response = httpx.post(f"{stack.gateway_url}/v1/completions", json=BODY, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert scheduled(stack) == before + 1  # the EPP picked it: the TLS stream worked
    frame = tls_hello(stack, stack.pki.ca_file, client_cert=True)
    assert frame[3] == HTTP2_SETTINGS_FRAME


@pytest.mark.parametrize("mode", ["FailClose", "FailOpen"])
def test_a_gateway_that_trusts_another_ca_follows_the_failure_mode(
    stack: LocalStack, gateways: list[Component], tmp_path: Path, mode: FailureMode
) -> None:
    assert stack.epp_tls is not None
    other_ca, _, _ = write_ca(tmp_path, "another CA")
    url = extra_gateway(stack, gateways, dataclasses.replace(stack.epp_tls, ca_file=other_ca), mode)
    before = scheduled(stack)
    responses = [httpx.post(f"{url}/v1/completions", json=BODY, timeout=10) for _ in range(3)]
    if mode == "FailClose":
        assert [r.status_code for r in responses] == [500] * 3
        assert responses[0].json()["error"]["message"] == "the endpoint picker failed"
    else:
        assert [r.status_code for r in responses] == [200] * 3
    assert scheduled(stack) == before  # nothing reached the EPP
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_hello(stack, other_ca, client_cert=True)


def test_under_mtls_a_client_without_a_certificate_is_refused(
    stack: LocalStack, gateways: list[Component]
) -> None:
    assert stack.epp_tls is not None and stack.pki is not None
    no_cert = dataclasses.replace(stack.epp_tls, client_cert_file=None, client_key_file=None)
    url = extra_gateway(stack, gateways, no_cert, "FailClose")
    before = scheduled(stack)
    response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert scheduled(stack) == before
    # Under TLS 1.3 the client's side of the handshake ends first; the EPP then closes the
    # connection (gRPC sends no alert) instead of speaking HTTP/2.
    with contextlib.suppress(ssl.SSLError, ConnectionResetError):
        assert tls_hello(stack, stack.pki.ca_file, client_cert=False) == b""


def test_synced_replicas_serve_tls_and_are_health_checked_in_plaintext(tmp_path: Path) -> None:
    """``make run TLS=1 EPP_REPLICAS=2``: Envoy marks both EPPs healthy (plaintext health checks,
    TLS streams) and spreads streams over both."""
    stack = start_stack(tmp_path, replicas=2, sim_profile="instant", tls="tls", epp_replicas=2)
    try:
        admin = stack.config.ports.envoy_admin
        assert wait_for(lambda: stat(admin, "cluster.epp.membership_healthy") == 2)
        for _ in range(6):
            response = httpx.post(f"{stack.gateway_url}/v1/completions", json=BODY, timeout=10)
            assert response.status_code == 200, response.text
        per_epp = [metric_sum(url, SCHEDULED) for url in stack.epp_metrics_urls]
        assert sum(per_epp) == 6 and all(n > 0 for n in per_epp), per_epp
    finally:
        stack.stop()
