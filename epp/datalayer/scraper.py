"""Polls every endpoint's Prometheus ``/metrics``: on a short tick (50 ms by default) while the
endpoint is busy, on a slow one (1 s in the EPP, ``--idle-scrape-interval-s``) while it is idle.

One task per endpoint, started and stopped as the store adds and removes endpoints, so a
slow or dead endpoint never delays the others. A failed scrape (refused, reset, an HTTP error,
a body that is not metrics) takes the endpoint out of scheduling until the next success.

An endpoint is busy while the EPP has requests in flight there, while its last scrape showed
requests running or waiting (a peer replica's or another client's), for ``linger_s`` after the
EPP last routed a request there or saw one finish, and while it is out of scheduling (so that
it is back at the first good scrape). Otherwise its gauges do not move, and scraping them 20
times a second cost most of an idle EPP's CPU, growing with the pool (~400 ms of CPU a second
for 100 endpoints, 21 ms on the idle tick: ``llm-epp-bench idle``). The scraper follows the
request lifecycle (a :class:`LifecycleObserver`): a request routed to an idle endpoint ends
its poller's slow wait at once, so the next decisions there see a scrape taken after the
request was sent, and the fast tick goes on from there.
:meth:`MetricsScraper.hurry` does the same for every endpoint (flow control holding a request
wants fresh figures from the whole pool). No endpoint is scraped more often than the fast tick.

A late scrape alone does not take an endpoint out: vLLM serves ``/metrics`` on the event loop
that streams its tokens, so a busy engine answers it late, by seconds under heavy load, while
it keeps answering requests. The endpoint leaves scheduling when it has shown no sign of life
(a good scrape, or an answer to a request: ``EndpointStore.record_alive``) for ``timeout``
(0.5 s by default), counted from one fast tick before a scrape at the earliest (an idle engine
was not asked meanwhile). So a busy engine that stalls leaves within about ``interval +
timeout``, an idle one within about ``idle_interval + timeout`` (1.5 s in the EPP), or within
about ``timeout`` of a request routed to it; a busy one that answers stays, routed on its last
figures and the EPP's own counts. The client is
:class:`~epp.keepalive_http.KeepAliveHttp`, one kept-alive connection per endpoint: at 20
scrapes a second per endpoint a client's own CPU counts (httpx's ~1.5 ms a request was a fifth
of the EPP's CPU; aiohttp's ~480 µs, twice this one's). A body equal to the endpoint's last one
(an idle engine's) is not parsed again, only stamped fresh.

The same task reads the engine's context length from its ``/v1/models`` once it is healthy,
again every ``models_refresh_s`` (an engine restarted in place may serve another), and every
``models_retry_s`` while it cannot be read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.engine_metrics import MetricsParseError, parse_engine_metrics
from epp.datalayer.served_models import MODELS_PATH, ModelsParseError, parse_max_model_len, parse_model_root
from epp.keepalive_http import HttpError, KeepAliveHttp
from epp.scheduling.framework import RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.types import Endpoint, EndpointState, EngineMetrics

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"
MIN_WAIT_S = 0.01
"""The shortest a scrape is given, so that one is always tried before a verdict."""


class _Poller:
    """One endpoint's polling task, when its last scrape started, until when it counts as busy
    whatever its figures say, and the wait before its next scrape, which may be cut short."""

    __slots__ = ("_due", "_timer", "_wait", "busy_until", "client", "started", "task")

    def __init__(self, client: KeepAliveHttp) -> None:
        self.client = client
        self.task: asyncio.Task[None] | None = None
        self.started = float("-inf")
        self.busy_until = float("-inf")
        self._wait: asyncio.Future[None] | None = None
        self._timer: asyncio.Handle | None = None
        self._due = float("inf")
        """When the wait ends, on the loop's clock (uvloop's zero-delay handles do not say)."""

    async def sleep(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less if :meth:`hurry` says so meanwhile."""
        self._wait = asyncio.get_running_loop().create_future()
        self._end_wait_in(delay)
        try:
            await self._wait
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._wait = self._timer = None

    def hurry(self, delay: float) -> None:
        """End the current wait within ``delay`` seconds (if it would end later)."""
        if self._wait is None or self._wait.done():
            return
        if self._due > asyncio.get_running_loop().time() + delay:
            self._end_wait_in(delay)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.client.close()

    def _end_wait_in(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._due = loop.time() + delay
        self._timer = loop.call_later(delay, _settle, self._wait)


def _settle(wait: asyncio.Future[None]) -> None:
    if not wait.done():
        wait.set_result(None)


class MetricsScraper(LifecycleObserver):
    def __init__(
        self,
        store: EndpointStore,
        clock: Callable[[], float],
        interval: float = 0.05,
        timeout: float = 0.5,
        models_refresh_s: float = 60.0,
        models_retry_s: float = 10.0,
        idle_interval: float | None = None,
        linger_s: float = 2.0,
    ) -> None:
        """``interval`` is the busy tick; ``idle_interval`` (None: the same) the idle one, never
        shorter than ``interval``; ``linger_s`` how long an endpoint stays busy after the EPP
        routed a request there or saw one finish."""
        self.store = store
        self.clock = clock
        self.interval = interval
        self.idle_interval = max(interval, idle_interval if idle_interval is not None else interval)
        self.linger_s = linger_s
        self.models_refresh_s = models_refresh_s
        self.models_retry_s = models_retry_s
        self.timeout = timeout
        self._pollers: dict[str, _Poller] = {}
        self._last: dict[str, tuple[bytes, EngineMetrics]] = {}
        """Each endpoint's last parsed scrape: its body and figures."""

    def start(self) -> None:
        self.store.subscribe(on_added=self._start_endpoint, on_removed=self._stop_endpoint)

    def _start_endpoint(self, endpoint: Endpoint) -> None:
        self._stop_endpoint(endpoint)
        poller = self._pollers[endpoint.name] = _Poller(KeepAliveHttp(endpoint.address, endpoint.port))
        poller.task = asyncio.get_running_loop().create_task(
            self._poll(endpoint, poller), name=f"scrape-{endpoint.name}"
        )

    def _stop_endpoint(self, endpoint: Endpoint) -> None:
        poller = self._pollers.pop(endpoint.name, None)
        self._last.pop(endpoint.name, None)
        if poller is not None:
            poller.close()

    async def _poll(self, endpoint: Endpoint, poller: _Poller) -> None:
        models_due = self.clock()
        while True:
            started = poller.started = self.clock()
            await self.scrape_once(endpoint.name, poller.client)
            if started >= models_due and self.store.is_healthy(endpoint.name):
                learned = await self.read_max_model_len(endpoint.name, poller.client)
                models_due = started + (self.models_refresh_s if learned else self.models_retry_s)
            period = self.period(endpoint.name, self.clock())
            await poller.sleep(max(0.0, started + period - self.clock()))

    def period(self, name: str, now: float) -> float:
        """The time from one scrape of ``name`` to the next: ``interval`` while it is busy (see
        the module's docstring), ``idle_interval`` otherwise."""
        state = self.store.by_name(name)
        poller = self._pollers.get(name)
        if state is None or poller is None:
            return self.interval
        busy = (
            state.in_flight > 0
            or _engine_busy(state.metrics)
            or now < poller.busy_until
            or not self.store.is_healthy(name)
        )
        return self.interval if busy else self.idle_interval

    def hurry(self) -> None:
        """Scrape every endpoint as soon as the fast tick allows (see :meth:`_hurry`)."""
        now = self.clock()
        for poller in self._pollers.values():
            self._hurry(poller, now)

    def _hurry(self, poller: _Poller, now: float) -> None:
        """End ``poller``'s wait one ``interval`` after its last scrape started: at once if that
        was an ``interval`` ago or more; a shorter wait stays as it is."""
        poller.hurry(max(0.0, poller.started + self.interval - now))

    def _active(self, name: str, now: float) -> None:
        """The EPP sent ``name`` a request or saw one end at ``now``: busy for ``linger_s``,
        and scraped as soon as the fast tick allows."""
        poller = self._pollers.get(name)
        if poller is not None:
            poller.busy_until = max(poller.busy_until, now + self.linger_s)
            self._hurry(poller, now)

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        self._active(routed.endpoint_name, now)

    def on_rebooked(self, routed: RoutedRequest, previous: EndpointState, now: float) -> None:
        self._active(routed.endpoint_name, now)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self._active(routed.endpoint_name, outcome.finished_at)

    async def scrape_once(self, name: str, client: KeepAliveHttp) -> None:
        # A healthy endpoint's scrape may take until it has shown no life for ``timeout``,
        # counted as if it had been asked on the fast tick: an idle one was last asked up to an
        # idle interval ago, and its silence since then is no sign of a stall.
        now = self.clock()
        wait_s = self.timeout
        if self.store.is_healthy(name):
            silent_since = max(self.store.alive_at(name), now - self.interval)
            wait_s = max(silent_since + self.timeout - now, MIN_WAIT_S)
        try:
            async with asyncio.timeout(wait_s):
                body = await client.get(METRICS_PATH)
            metrics = self._parse(name, body)
        except TimeoutError:
            if self.clock() - self.store.alive_at(name) < self.timeout:
                return  # late, but the engine answered requests meanwhile: busy, not stalled
            self._failed(name, f"no sign of life for {self.timeout:g} s (scrape timed out)")
            return
        except (HttpError, MetricsParseError) as exc:
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

    async def read_max_model_len(self, name: str, client: KeepAliveHttp) -> bool:
        """Record the engine's context length, and the model it serves (its ``root``, which the
        ``auto`` tokenizer source loads), from its ``/v1/models``; False if it could not be read."""
        try:
            async with asyncio.timeout(self.timeout):
                body = await client.get(MODELS_PATH)
            max_model_len = parse_max_model_len(body)
        except (HttpError, TimeoutError, ModelsParseError) as exc:
            state = self.store.by_name(name)
            if state is not None and state.max_model_len is None:
                log.warning("endpoint %s: no context length yet: %s", name, str(exc) or type(exc).__name__)
            return False
        self.store.record_max_model_len(name, max_model_len)
        self.store.record_model_root(name, parse_model_root(body))
        return True

    async def close(self) -> None:
        tasks = [p.task for p in self._pollers.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for poller in self._pollers.values():
            poller.close()
        self._pollers.clear()


def _engine_busy(metrics: EngineMetrics) -> bool:
    """The engine's last scrape showed requests running or waiting (whoever sent them)."""
    return metrics.running > 0 or metrics.waiting > 0
