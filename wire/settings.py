"""Settings fields the training server and the prediction servers share."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

HealthPort = Annotated[
    int | None,
    Field(
        ge=0,
        le=65535,
        description="also serve /healthz, /readyz and /metrics alone on this port, all interfaces",
    ),
]
"""The optional port for probes and metrics alone (``wire.webapp.serve``'s ``health_port``)."""
