"""Endpoints from a static YAML file, reloaded when the file changes.

Format::

    endpoints:
    - name: sim-0          # unique; defaults to address:port
      address: 127.0.0.1
      port: 8100
      labels: {zone: a}    # optional
      kv_events_endpoint: tcp://127.0.0.1:5557          # optional: vLLM KV events (ZMQ PUB)
      kv_events_replay_endpoint: tcp://127.0.0.1:5558   # optional: their replay (ZMQ ROUTER)

A file that fails to parse or validate is reported and ignored: the last good set stays.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from epp.datalayer.endpoints import EndpointStore
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)


class EndpointsFileError(ValueError):
    """The endpoints file is unreadable or invalid."""


class EndpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    address: str
    port: int = Field(ge=1, le=65535)
    labels: dict[str, str] = Field(default_factory=dict)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    @field_validator("address")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        # Envoy's original-destination cluster needs an IP, not a host name.
        ipaddress.ip_address(value)
        return value


class EndpointsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endpoints: list[EndpointSpec]


def load_endpoints(path: Path) -> list[Endpoint]:
    try:
        data = yaml.safe_load(path.read_text())
        spec = EndpointsFile.model_validate(data)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise EndpointsFileError(f"{path}: {exc}") from exc
    endpoints = [
        Endpoint(
            name=e.name or f"{e.address}:{e.port}",
            address=e.address,
            port=e.port,
            labels=e.labels,
            kv_events_endpoint=e.kv_events_endpoint,
            kv_events_replay_endpoint=e.kv_events_replay_endpoint,
        )
        for e in spec.endpoints
    ]
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise EndpointsFileError(f"{path}: endpoint names must be unique")
    return endpoints


class StaticFileSource:
    """Keeps an :class:`EndpointStore` equal to the file's contents."""

    def __init__(self, path: Path, store: EndpointStore, poll_interval: float = 1.0) -> None:
        self.path = path
        self.store = store
        self.poll_interval = poll_interval
        self._seen: tuple[float, int] | None = None

    def load(self) -> None:
        """Read the file now; raise :class:`EndpointsFileError` if it is invalid."""
        stat = self.path.stat()
        self.store.replace(load_endpoints(self.path))
        self._seen = (stat.st_mtime, stat.st_size)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                stat = self.path.stat()
            except OSError as exc:
                log.warning("endpoints file %s unreadable: %s", self.path, exc)
                continue
            if (stat.st_mtime, stat.st_size) == self._seen:
                continue
            try:
                self.load()
                log.info("reloaded %d endpoints from %s", len(self.store.all()), self.path)
            except EndpointsFileError as exc:
                self._seen = (stat.st_mtime, stat.st_size)
                log.error("keeping the previous endpoints: %s", exc)
