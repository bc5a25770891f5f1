"""Polls every endpoint's Prometheus ``/metrics`` on a short tick (50 ms by default).

One task per endpoint, started and stopped as the store adds and removes endpoints, so a
slow or dead endpoint never delays the others. A failed scrape takes the endpoint out of
scheduling until the next success.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.engine_metrics import MetricsParseError, parse_engine_metrics
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)


class MetricsScraper:
    def __init__(
        self,
        store: EndpointStore,
        clock: Callable[[], float],
        interval: float = 0.05,
        timeout: float = 1.0,
    ) -> None:
        self.store = store
        self.clock = clock
        self.interval = interval
        self.timeout = timeout
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=None))
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.scrapes = 0
        self.failures = 0

    def start(self) -> None:
        self.store.subscribe(on_added=self._start_endpoint, on_removed=self._stop_endpoint)

    def _start_endpoint(self, endpoint: Endpoint) -> None:
        self._stop_endpoint(endpoint)
        self._tasks[endpoint.name] = asyncio.get_running_loop().create_task(
            self._poll(endpoint), name=f"scrape-{endpoint.name}"
        )

    def _stop_endpoint(self, endpoint: Endpoint) -> None:
        task = self._tasks.pop(endpoint.name, None)
        if task is not None:
            task.cancel()

    async def _poll(self, endpoint: Endpoint) -> None:
        url = f"http://{endpoint.hostport}/metrics"
        while True:
            started = self.clock()
            await self.scrape_once(endpoint, url)
            await asyncio.sleep(max(0.0, self.interval - (self.clock() - started)))

    async def scrape_once(self, endpoint: Endpoint, url: str) -> None:
        self.scrapes += 1
        try:
            response = await self._client.get(url)
            response.raise_for_status()
            metrics = parse_engine_metrics(response.content, self.clock())
        except (httpx.HTTPError, MetricsParseError) as exc:
            self.failures += 1
            if self.store.is_healthy(endpoint.name):
                log.warning("endpoint %s unhealthy: %s", endpoint.name, exc or type(exc).__name__)
            self.store.record_failure(endpoint.name, str(exc) or type(exc).__name__)
            return
        self.store.record_scrape(endpoint.name, metrics)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        await self._client.aclose()
