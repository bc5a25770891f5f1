"""Hot reload: find new model versions, verify them, and swap them in whole.

Two sources: the training server over HTTP (:class:`TrainerSource`: ``/model/download/info``,
then ``/model/{name}/download?version=N``) or the trainer's model directory on a shared volume
(:class:`DirectorySource`). Either way the manifest is read first and every file is checked
against it (size, sha256, XGBoost load, feature columns) before the new :class:`ModelSet`
replaces the old one in a single reference assignment. A version that fails any check is never
served: the last good one keeps serving, and the failure is logged and counted
(``predictor_model_load_failures_total{reason}``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import httpx

from predictor.metrics import PredictorMetrics
from predictor.models import ModelSet, build_model_set
from trainer.artifacts import MANIFEST_NAME, ArtifactError, Manifest, ModelInfo, ModelName, parse_manifest

log = logging.getLogger(__name__)


class ModelSource(Protocol):
    description: str

    async def manifest(self) -> Manifest | None:
        """The current manifest, None if no version exists yet; raises on failure."""
        ...

    async def model_bytes(self, info: ModelInfo) -> bytes:
        """The bytes of the model file ``info`` describes; raises on failure."""
        ...

    async def close(self) -> None: ...


class TrainerSource:
    """Models pulled from the training server's HTTP API."""

    def __init__(self, trainer_url: str, timeout_s: float = 30.0) -> None:
        self.description = f"trainer {trainer_url}"
        self._client = httpx.AsyncClient(base_url=trainer_url.rstrip("/"), timeout=timeout_s)

    async def manifest(self) -> Manifest | None:
        response = await self._client.get("/model/download/info")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return parse_manifest(response.content)

    async def model_bytes(self, info: ModelInfo) -> bytes:
        # The version pins the file: the trainer may publish a newer one meanwhile.
        response = await self._client.get(f"/model/{info.name}/download", params={"version": info.version})
        response.raise_for_status()
        return response.content

    async def close(self) -> None:
        await self._client.aclose()


class DirectorySource:
    """Models read from the trainer's model directory (a shared volume)."""

    def __init__(self, directory: Path) -> None:
        self.description = f"directory {directory}"
        self.directory = directory

    async def manifest(self) -> Manifest | None:
        try:
            data = await asyncio.to_thread((self.directory / MANIFEST_NAME).read_bytes)
        except FileNotFoundError:
            return None
        return parse_manifest(data)

    async def model_bytes(self, info: ModelInfo) -> bytes:
        try:
            return await asyncio.to_thread((self.directory / info.file).read_bytes)
        except FileNotFoundError:
            raise ArtifactError("missing", f"{info.file} is not in {self.directory}") from None

    async def close(self) -> None:
        return None


def _identity(manifest: Manifest) -> tuple[int, tuple[str, ...]]:
    return manifest.version, tuple(info.sha256 for info in manifest.models.values())


FIRST_MODEL_POLL_S = 1.0
"""How often to poll while no model is served, when ``poll_interval_s`` is longer: until the first
model the EPP routes on its heuristic fallback, so a few seconds of polling lag count."""


class ModelReloader:
    """Holds the served :class:`ModelSet` (``current``) and replaces it when the source has a
    different version. Run :meth:`run_forever` as a task, or call :meth:`poll_once`."""

    def __init__(
        self, source: ModelSource, metrics: PredictorMetrics, *, poll_interval_s: float, threads: int = 1
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.threads = threads
        self.current: ModelSet | None = None
        self._loaded: tuple[int, tuple[str, ...]] | None = None
        self._last_failure: str | None = None
        self.loads = 0
        """Versions loaded and swapped in."""
        self._polling = asyncio.Lock()
        self.failures = 0
        """Load attempts that failed (the last good version kept serving)."""

    async def run_forever(self) -> None:
        """Poll every ``poll_interval_s`` (every ``FIRST_MODEL_POLL_S`` until a model is served)."""
        while True:
            await self.poll_once()
            interval = self.poll_interval_s
            if self.current is None:
                interval = min(interval, FIRST_MODEL_POLL_S)
            await asyncio.sleep(interval)

    async def poll_once(self) -> bool:
        """Look for a new version and swap it in; True if one was. Never raises (but cancels).

        Polls are serialised, so two at once (the background loop and a caller) never load the
        same version twice.
        """
        async with self._polling:
            return await self._poll()

    async def _poll(self) -> bool:
        try:
            manifest = await self.source.manifest()
            if manifest is None or _identity(manifest) == self._loaded:
                return False
            blobs: dict[ModelName, bytes] = {}
            for name, info in manifest.models.items():
                blobs[name] = await self.source.model_bytes(info)
            models = await asyncio.to_thread(
                build_model_set,
                manifest,
                blobs,
                loaded_at=datetime.now(UTC),
                source=self.source.description,
                threads=self.threads,
            )
        except ArtifactError as exc:
            self._failed(exc.reason, str(exc))
            return False
        except (httpx.HTTPError, OSError) as exc:
            self._failed("fetch", f"{self.source.description}: {exc!r}")
            return False
        self.current = models
        self._loaded = _identity(manifest)
        self._last_failure = None
        self.loads += 1
        self.metrics.model_loads.inc()
        self.metrics.model_version.set(models.version)
        log.info("serving model version %d from %s", models.version, self.source.description)
        return True

    def _failed(self, reason: str, message: str) -> None:
        self.failures += 1
        self.metrics.load_failures.labels(reason).inc()
        serving = f"still serving version {self.current.version}" if self.current else "no model yet"
        # The same failure every poll is logged once.
        level = logging.DEBUG if message == self._last_failure else logging.WARNING
        log.log(level, "model reload failed (%s): %s; %s", reason, message, serving)
        self._last_failure = message
