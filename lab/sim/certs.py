"""A throwaway certificate authority for the local stack's TLS (``make run TLS=1``) and the TLS
tests: a CA, a server certificate for the EPP and a client certificate for the gateway (mTLS),
written as PEM files. EC P-256 keys; valid for a week. Never for production: the CA's key lies
next to the certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

EPP_SERVER_NAME = "epp.llm-epp.local"
"""The DNS name in the EPP's certificate; the gateway sends it as SNI and checks it."""
VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class LocalPki:
    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path
    server_name: str = EPP_SERVER_NAME


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: x509.ObjectIdentifier | None = None,
    names: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    """A certificate for ``key``: self-signed CA when ``issuer`` is None, else a leaf it signs."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        key_usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    else:
        key_usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    builder = builder.add_extension(key_usage, critical=True)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_ca(
    directory: Path, name: str = "llm-epp local CA"
) -> tuple[Path, x509.Name, ec.EllipticCurvePrivateKey]:
    """A new CA certificate in ``directory/<slug>.crt``; returns it with the CA's name and key."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(name, key, None)
    path = directory / f"{name.replace(' ', '-')}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert.subject, key


def write_local_pki(directory: Path, server_name: str = EPP_SERVER_NAME) -> LocalPki:
    """A CA, the EPP's server certificate (``server_name``, localhost, 127.0.0.1) and a client
    certificate, all in ``directory``."""
    ca_file, ca_name, ca_key = write_ca(directory)
    files = {}
    for role, usage, names in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, [x509.DNSName(server_name), x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("gateway.llm-epp.local")]),
    ):  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"llm-epp {role}", key, (ca_name, ca_key), usage=usage, names=names)
        cert_file, key_file = directory / f"{role}.crt", directory / f"{role}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_file, key)
        files[role] = (cert_file, key_file)
    return LocalPki(ca_file, *files["server"], *files["client"], server_name=server_name)
