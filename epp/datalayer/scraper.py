"""Polls every endpoint's Prometheus ``/metrics`` on a short tick (50 ms by default).

One task per endpoint, started and stopped as the store adds and removes endpoints, so a
slow or dead endpoint never delays the others. A failed scrape (refused, reset, an HTTP error,
a body that is not metrics) takes the endpoint out of scheduling until the next success.

A late scrape alone does not: vLLM serves ``/metrics`` on the event loop that streams its
tokens, so a busy engine answers it late, by seconds under heavy load, while it keeps
answering requests. The endpoint leaves scheduling when it has shown no sign of life (a good
scrape, or an answer to a request: ``EndpointStore.record_alive``) for ``timeout`` (0.5 s by
default), so an engine that stalls leaves within about ``interval + timeout``, and a busy one
stays, routed on its last figures and the EPP's own counts. The
client is aiohttp with keep-alive: at 20 scrapes a second per endpoint, httpx's per-request
cost (~1.5 ms of CPU) was a fifth of the EPP's CPU. A body equal to the endpoint's last one (an
idle engine's) is not parsed again, only stamped fresh.

The same task reads the engine's context length from its ``/v1/models`` once it is healthy,
again every ``models_refresh_s`` (an engine restarted in place may serve another), and every
``models_retry_s`` while it cannot be read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import aiohttp

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.engine_metrics import MetricsParseError, parse_engine_metrics
from epp.datalayer.served_models import MODELS_PATH, ModelsParseError, parse_max_model_len
from epp.scheduling.types import Endpoint, EngineMetrics

log = logging.getLogger(__name__)
MIN_WAIT_S = 0.01
"""The shortest a scrape is given, so that one is always tried before a verdict."""


class MetricsScraper:
    def __init__(
        self,
        store: EndpointStore,
        clock: Callable[[], float],
        interval: float = 0.05,
        timeout: float = 0.5,
        models_refresh_s: float = 60.0,
        models_retry_s: float = 10.0,
    ) -> None:
        self.store = store
        self.clock = clock
        self.interval = interval
        self.models_refresh_s = models_refresh_s
        self.models_retry_s = models_retry_s
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._last: dict[str, tuple[bytes, EngineMetrics]] = {}
        """Each endpoint's last parsed scrape: its body and figures."""

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
        )
        self.store.subscribe(on_added=self._start_endpoint, on_removed=self._stop_endpoint)

    def _start_endpoint(self, endpoint: Endpoint) -> None:
        self._stop_endpoint(endpoint)
        self._tasks[endpoint.name] = asyncio.get_running_loop().create_task(
            self._poll(endpoint), name=f"scrape-{endpoint.name}"
        )

    def _stop_endpoint(self, endpoint: Endpoint) -> None:
        task = self._tasks.pop(endpoint.name, None)
        self._last.pop(endpoint.name, None)
        if task is not None:
            task.cancel()

    async def _poll(self, endpoint: Endpoint) -> None:
        url = f"http://{endpoint.hostport}/metrics"
        models_due = self.clock()
        while True:
            started = self.clock()
            await self.scrape_once(endpoint, url)
            if started >= models_due and self.store.is_healthy(endpoint.name):
                learned = await self.read_max_model_len(endpoint)
                models_due = started + (self.models_refresh_s if learned else self.models_retry_s)
            await asyncio.sleep(max(0.0, self.interval - (self.clock() - started)))

    async def scrape_once(self, endpoint: Endpoint, url: str) -> None:
        assert self._session is not None, "start() first"
        name = endpoint.name
        # A healthy endpoint's scrape may take until it has shown no life for ``timeout``.
        wait_s = self.timeout
        if self.store.is_healthy(name):
            wait_s = max(self.store.alive_at(name) + self.timeout - self.clock(), MIN_WAIT_S)
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=wait_s)) as response:
                response.raise_for_status()
                body = await response.read()
            metrics = self._parse(name, body)
        except TimeoutError as exc:  # aiohttp's own timeouts are TimeoutErrors too
            if self.clock() - self.store.alive_at(name) < self.timeout:
                return  # late, but the engine answered requests meanwhile: busy, not stalled
            self._failed(name, f"no sign of life for {self.timeout:g} s ({str(exc) or 'scrape timed out'})")
            return
        except (aiohttp.ClientError, MetricsParseError) as exc:
            self._failed(name, str(exc) or type(exc).__name__)
            return
        self.store.record_scrape(name, metrics)

    def _failed(self, name: str, why: str) -> None:
        if self.store.is_healthy(name):
            log.warning("endpoint %s unhealthy: %s", name, why)
        self.store.record_failure(name, why)

    def _parse(self, name: str, body: bytes) -> EngineMetrics:
        """The scrape's figures, stamped now; a body equal to the endpoint's last one (an idle
        engine's) is not parsed again."""
        now = self.clock()
        last = self._last.get(name)
        if last is not None and last[0] == body:
            return dataclasses.replace(last[1], updated_at=now)
        metrics = parse_engine_metrics(body, now)
        self._last[name] = (body, metrics)
        return metrics

    async def read_max_model_len(self, endpoint: Endpoint) -> bool:
        """Record the engine's context length from its ``/v1/models``; False if it could not be read."""
        assert self._session is not None, "start() first"
        try:
            async with self._session.get(f"http://{endpoint.hostport}{MODELS_PATH}") as response:
                response.raise_for_status()
                body = await response.read()
            max_model_len = parse_max_model_len(body)
        except (aiohttp.ClientError, TimeoutError, ModelsParseError) as exc:
            state = self.store.by_name(endpoint.name)
            if state is not None and state.max_model_len is None:
                log.warning(
                    "endpoint %s: no context length yet: %s", endpoint.name, str(exc) or type(exc).__name__
                )
            return False
        self.store.record_max_model_len(endpoint.name, max_model_len)
        return True

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
