"""The EPP's live view of the pool: endpoints, their scraped metrics, and its own counts.

An endpoint is a scheduling candidate while its last metrics scrape succeeded and no
upstream failure has been reported since. Scrapes and failures are recorded with the
injected clock's time, and so is the endpoint's last sign of life (a good scrape, or an answer
to a request), by which the scraper tells a busy engine from a stalled one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from epp.scheduling.types import Endpoint, EndpointState, EngineMetrics

Listener = Callable[[Endpoint], None]


@dataclass(slots=True)
class _Entry:
    state: EndpointState
    healthy: bool = False
    last_error: str | None = None
    alive_at: float = float("-inf")
    model_root: str | None = None
    """The base model its ``/v1/models`` names (``epp.datalayer.served_models.parse_model_root``)."""


class EndpointStore:
    """Endpoints by name. Add/remove listeners let the scraper and indexes follow changes."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._candidates: list[EndpointState] | None = None
        self._max_model_len: int | None = None
        self._on_added: list[Listener] = []
        self._on_removed: list[Listener] = []

    def subscribe(self, on_added: Listener | None = None, on_removed: Listener | None = None) -> None:
        if on_added:
            self._on_added.append(on_added)
            for entry in self._entries.values():
                on_added(entry.state.endpoint)
        if on_removed:
            self._on_removed.append(on_removed)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        """Make the pool exactly ``endpoints``. Known endpoints keep their metrics and counts."""
        wanted = {e.name: e for e in endpoints}
        for name in [n for n, entry in self._entries.items() if wanted.get(n) != entry.state.endpoint]:
            removed = self._entries.pop(name)
            for listener in self._on_removed:
                listener(removed.state.endpoint)
        for name, endpoint in wanted.items():
            if name not in self._entries:
                self._entries[name] = _Entry(EndpointState(endpoint, EngineMetrics()))
                for listener in self._on_added:
                    listener(endpoint)
        self._candidates = None
        self._update_max_model_len()

    def record_scrape(self, name: str, metrics: EngineMetrics) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        entry.state.metrics = metrics
        if not entry.healthy:
            self._candidates = None
        entry.healthy = True
        entry.last_error = None
        entry.alive_at = max(entry.alive_at, metrics.updated_at)

    def record_alive(self, name: str, now: float) -> None:
        """The endpoint answered a request at ``now`` (it is alive, whatever its scrapes say);
        this alone does not make an unhealthy endpoint a candidate again."""
        entry = self._entries.get(name)
        if entry is not None and now > entry.alive_at:
            entry.alive_at = now

    def alive_at(self, name: str) -> float:
        """When the endpoint last showed life (-inf: never, or not in the pool)."""
        entry = self._entries.get(name)
        return entry.alive_at if entry is not None else float("-inf")

    def record_max_model_len(self, name: str, max_model_len: int) -> None:
        entry = self._entries.get(name)
        if entry is not None:
            entry.state.max_model_len = max_model_len
            self._update_max_model_len()

    def record_model_root(self, name: str, root: str | None) -> None:
        entry = self._entries.get(name)
        if entry is not None:
            entry.model_root = root

    def model_roots(self) -> dict[str, str]:
        """The model each endpoint serves, by endpoint name, for those whose ``/v1/models`` named one."""
        return {name: e.model_root for name, e in self._entries.items() if e.model_root is not None}

    def max_model_len(self) -> int | None:
        """The longest context any endpoint has reported (None: none has): a prompt longer than
        this fits nowhere in the pool. Read on every request, so kept as the endpoints change."""
        return self._max_model_len

    def _update_max_model_len(self) -> None:
        self._max_model_len = max(
            (e.state.max_model_len for e in self._entries.values() if e.state.max_model_len), default=None
        )

    def record_failure(self, name: str, error: str) -> None:
        """A scrape or an upstream request failed: stop routing there until a scrape succeeds."""
        entry = self._entries.get(name)
        if entry is None:
            return
        if entry.healthy:
            self._candidates = None
        entry.healthy = False
        entry.last_error = error

    def candidates(self) -> list[EndpointState]:
        """Healthy endpoints, in a stable order. The list is shared: callers must not mutate it."""
        if self._candidates is None:
            self._candidates = [e.state for e in self._entries.values() if e.healthy]
        return self._candidates

    def all(self) -> list[EndpointState]:
        return [e.state for e in self._entries.values()]

    def is_healthy(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.healthy

    def by_name(self, name: str) -> EndpointState | None:
        entry = self._entries.get(name)
        return entry.state if entry else None
