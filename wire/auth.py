"""The bearer token that guards a sidecar's mutating routes once it is reachable beyond its pod.

By default the trainer binds loopback: only processes in its own pod (the EPP, the predictors)
reach it, and it needs no token. Binding any other address is allowed only with a token file
(in Kubernetes, a Secret mounted into the pod); every mutating route then answers 401 to a
request without ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable only from this machine or pod."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str, token_file: Path | None) -> None:
    """:class:`ValueError` unless ``host`` is loopback or a token file is given."""
    if token_file is None and not is_loopback(host):
        raise ValueError(
            f"binding {host} exposes the training routes beyond this pod: give --auth-token-file "
            "(a token from a Secret), or bind 127.0.0.1"
        )


class TokenFileError(Exception):
    """A token file that cannot be read, or holds no token."""


def read_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace dropped; :class:`TokenFileError` if the file
    cannot be read or is empty."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc}") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    return token


class BearerToken:
    """Checks ``Authorization`` headers against one token, in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allows(self, authorization: str | None) -> bool:
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._expected)
