"""Throwaway TLS material for tests: a CA and the certificates it signs, written as PEM files
(made with the ``cryptography`` package; EC P-256 keys, valid for a day)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class CertAuthority:
    """A self-signed CA; ``issue`` signs server or client certificates with it."""

    cert: Path
    _cert: x509.Certificate
    _key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, directory: Path, name: str = "test-ca") -> CertAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        path = directory / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(path, cert, key)

    def issue(self, directory: Path, name: str, *, server_ip: str | None = None) -> Issued:
        """A certificate for ``name``: a server's for ``server_ip`` (its IP SAN), else a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_ip else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = _builder(subject, self._cert.subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if server_ip:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_ip))]), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert_path, key_path)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
