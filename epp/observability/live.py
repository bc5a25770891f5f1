"""The data behind the live ``/dashboard`` page: the pool's endpoints as the EPP sees them now,
the recent decisions and the totals, as one JSON-ready dict.

Read on the metrics server's thread, like the Prometheus collectors: it only reads the store,
the token-load trackers and :class:`~epp.observability.recent.RecentDecisions`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from epp.datalayer.endpoints import EndpointStore
from epp.load.peer_totals import PeerTotals
from epp.load.token_load import NO_LOAD, EndpointLoad, TokenLoadTracker
from epp.observability.recent import Decision, RecentDecisions

SHOWN_DECISIONS = 200
"""Decisions sent to the page (its chart and table), newest last; the window of its rates."""


class LiveData:
    def __init__(
        self,
        pool: str,
        profile: str,
        store: EndpointStore,
        recent: RecentDecisions,
        clock: Callable[[], float],
        token_load: Sequence[TokenLoadTracker | PeerTotals] = (),
    ) -> None:
        """``token_load``: what makes an endpoint's load (this replica's bookings, plus its synced
        peers' totals); none when the scheduling profile books no tokens."""
        self.pool, self.profile, self.store, self.recent, self.clock = pool, profile, store, recent, clock
        self.token_load = tuple(token_load)

    def _load(self, name: str) -> EndpointLoad:
        total = NO_LOAD
        for tracker in self.token_load:
            total = total + tracker.load(name)
        return total

    def _endpoints(self) -> list[dict[str, Any]]:
        rows = []
        for s in self.store.all():
            load = self._load(s.name)
            rows.append(
                {
                    "name": s.name,
                    "healthy": self.store.is_healthy(s.name),
                    "token_load": load.tokens_in_flight if self.token_load else None,
                    "queue": s.metrics.waiting,
                    "running": s.metrics.running,
                    "in_flight": s.in_flight,
                    "kv_usage": s.metrics.kv_cache_usage,
                }
            )
        return rows

    @staticmethod
    def _window(decisions: Sequence[Decision]) -> dict[str, Any]:
        """Rates over ``decisions``: SLO attainment, fallbacks, TTFT prediction error."""
        checked = [d.slo_met for d in decisions if d.slo_met is not None]
        errors = [
            abs(d.predicted_ttft_ms - d.ttft_ms) / d.ttft_ms
            for d in decisions
            if d.predicted_ttft_ms is not None and d.ttft_ms
        ]
        return {
            "requests": len(decisions),
            "slo_attainment": sum(checked) / len(checked) if checked else None,
            "fallbacks": dict(Counter(d.fallback for d in decisions if d.fallback is not None)),
            "ttft_error": statistics.median(errors) if errors else None,
        }

    def snapshot(self) -> dict[str, Any]:
        decisions, totals = self.recent.snapshot()
        shown = decisions[-SHOWN_DECISIONS:]
        now = self.clock()
        return {
            "pool": self.pool,
            "profile": self.profile,
            "endpoints": self._endpoints(),
            "totals": asdict(totals),
            "window": self._window(shown),
            "decisions": [{**asdict(d), "age_s": round(now - d.finished_at, 3)} for d in shown],
        }
