"""The EPP's ext_proc TLS flags and the certificate reload (the handshakes: tests/integration/
test_ext_proc_tls.py)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from epp.settings import EppSettings
from epp.tls import ServerTlsFiles, _CertificateReloader
from sim.certs import write_local_pki

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
