"""The EPP's ext_proc TLS flags and the certificate reload (the handshakes: tests/integration/
test_ext_proc_tls.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from epp.app import EppApp
from epp.settings import EppSettings
from epp.tls import ServerTlsFiles, _CertificateReloader
from sim.certs import write_local_pki
from tests.epp.factories import local_epp_settings

BASE = {"endpoints_file": "endpoints.yaml", "tokenizer_dir": "tok"}


def test_tls_flags_go_together() -> None:
    with pytest.raises(ValidationError, match="go together"):
        EppSettings(**BASE, grpc_tls_cert_file="c.pem")
    with pytest.raises(ValidationError, match="mTLS"):
        EppSettings(**BASE, grpc_tls_client_ca_file="ca.pem")
    assert EppSettings(**BASE).grpc_tls() is None
    files = EppSettings(
        **BASE, grpc_tls_cert_file="c.pem", grpc_tls_key_file="k.pem", grpc_tls_client_ca_file="ca.pem"
    ).grpc_tls()
    assert files == ServerTlsFiles(Path("c.pem"), Path("k.pem"), Path("ca.pem"))


def test_a_rotated_certificate_is_picked_up_and_a_missing_one_keeps_the_last(tmp_path: Path) -> None:
    pki = write_local_pki(tmp_path / "a")
    reloader = _CertificateReloader(ServerTlsFiles(pki.server_cert_file, pki.server_key_file, pki.ca_file))
    assert isinstance(reloader.initial, grpc.ServerCertificateConfiguration)
    assert reloader() is None  # unchanged
    rotated = write_local_pki(tmp_path / "b")
    for new, old in (
        (rotated.server_cert_file, pki.server_cert_file),
        (rotated.server_key_file, pki.server_key_file),
    ):
        os.replace(new, old)  # as the kubelet swaps a Secret's files
    assert isinstance(reloader(), grpc.ServerCertificateConfiguration)
    assert reloader() is None
    pki.server_key_file.unlink()
    assert reloader() is None  # unreadable: the current certificate stays


def _handshake(port: int, ca_file: Path, server_name: str) -> None:
    """A TLS handshake with the EPP's ext_proc port, verifying against ``ca_file``."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name),
    ):
        pass


async def test_a_running_epp_serves_a_rotated_certificate_on_new_connections(tmp_path: Path) -> None:
    first, second = write_local_pki(tmp_path / "first"), write_local_pki(tmp_path / "second")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.server_cert_file, cert)
    shutil.copy(first.server_key_file, key)
    app = EppApp(local_epp_settings(tmp_path, grpc_tls_cert_file=cert, grpc_tls_key_file=key))
    await app.start()
    try:
        await asyncio.to_thread(_handshake, app.grpc_port, first.ca_file, first.server_name)
        for new, old in ((second.server_cert_file, cert), (second.server_key_file, key)):
            tmp = old.with_suffix(".new")
            shutil.copy(new, tmp)
            os.replace(tmp, old)
        await asyncio.to_thread(_handshake, app.grpc_port, second.ca_file, second.server_name)
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.to_thread(_handshake, app.grpc_port, first.ca_file, first.server_name)
    finally:
        await app.stop()
