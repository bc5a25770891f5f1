"""TLS for the EPP's ext_proc server: the certificate from files (a Kubernetes Secret mounted
into the pod), optionally requiring client certificates (mTLS).

The files are read again when any of them changes, so a rotated Secret (cert-manager renews
before expiry; the kubelet swaps the mounted files) takes effect on the next connection,
without a restart. A read that fails keeps the previous certificate and is logged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTlsFiles:
    cert_file: Path
    """PEM certificate chain the server presents."""
    key_file: Path
    """PEM private key of ``cert_file``."""
    client_ca_file: Path | None = None
    """PEM CA bundle; when given, a client must present a certificate it signed (mTLS)."""

    def paths(self) -> tuple[Path, ...]:
        return (self.cert_file, self.key_file, *((self.client_ca_file,) if self.client_ca_file else ()))


class _CertificateReloader:
    """Hands gRPC a new certificate configuration whenever a file's mtime or size changes."""

    def __init__(self, files: ServerTlsFiles) -> None:
        self.files = files
        self._stamp = self._current_stamp()
        self.initial = self._configuration()

    def _current_stamp(self) -> tuple[tuple[int, int], ...]:
        stats = [os.stat(p) for p in self.files.paths()]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        f = self.files
        return grpc.ssl_server_certificate_configuration(
            [(f.key_file.read_bytes(), f.cert_file.read_bytes())],
            root_certificates=f.client_ca_file.read_bytes() if f.client_ca_file else None,
        )

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: None keeps the current configuration."""
        try:
            stamp = self._current_stamp()
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except OSError as exc:
            log.warning("keeping the current ext_proc certificate: cannot read the new one: %s", exc)
            return None
        self._stamp = stamp
        log.info("ext_proc certificate reloaded from %s", self.files.cert_file)
        return configuration


def server_credentials(files: ServerTlsFiles) -> grpc.ServerCredentials:
    """Credentials for ``grpc.aio.Server.add_secure_port``; :class:`OSError` if a file is unreadable."""
    reloader = _CertificateReloader(files)
    return grpc.dynamic_ssl_server_credentials(
        reloader.initial, reloader, require_client_authentication=files.client_ca_file is not None
    )
