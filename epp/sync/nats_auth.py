"""How an EPP replica authenticates to the sync NATS and with what TLS: the options of
``nats.connect`` from the EPP's settings, secrets read from their files or else from the
environment. Apart from the transport (``epp.sync.nats_transport``) so that the settings, which
name the environment variables, need not import the NATS client."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

SYNC_TOKEN_ENV = "LLM_EPP_SYNC_NATS_TOKEN"
SYNC_PASSWORD_ENV = "LLM_EPP_SYNC_NATS_PASSWORD"


class NatsAuth(Protocol):
    """How to authenticate to NATS and with what TLS (``epp.settings.EppSettings`` is one)."""

    sync_nats_user: str | None
    sync_nats_password_file: Path | None
    sync_nats_token_file: Path | None
    sync_nats_nkey_seed_file: Path | None
    sync_nats_credentials_file: Path | None
    sync_nats_tls_ca_file: Path | None
    sync_nats_tls_cert_file: Path | None
    sync_nats_tls_key_file: Path | None


def _secret(path: Path | None, env: str, environ: Mapping[str, str]) -> str | None:
    if path is not None:
        return path.read_text(encoding="utf-8").strip()
    return environ.get(env) or None


def connect_options(settings: NatsAuth, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The auth and TLS keyword arguments of ``nats.connect`` that ``settings`` ask for (secrets
    from their files, else from the environment)."""
    s = settings
    options: dict[str, Any] = {}
    if s.sync_nats_user is not None:
        options["user"] = s.sync_nats_user
        options["password"] = _secret(s.sync_nats_password_file, SYNC_PASSWORD_ENV, environ)
    elif s.sync_nats_nkey_seed_file is not None:
        options["nkeys_seed"] = str(s.sync_nats_nkey_seed_file)
    elif s.sync_nats_credentials_file is not None:
        options["user_credentials"] = str(s.sync_nats_credentials_file)
    elif (token := _secret(s.sync_nats_token_file, SYNC_TOKEN_ENV, environ)) is not None:
        options["token"] = token
    if s.sync_nats_tls_ca_file is not None or s.sync_nats_tls_cert_file is not None:
        context = ssl.create_default_context(
            cafile=str(s.sync_nats_tls_ca_file) if s.sync_nats_tls_ca_file is not None else None
        )
        if s.sync_nats_tls_cert_file is not None and s.sync_nats_tls_key_file is not None:
            context.load_cert_chain(str(s.sync_nats_tls_cert_file), str(s.sync_nats_tls_key_file))
        options["tls"] = context
    return options
