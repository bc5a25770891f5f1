"""A per-instance circuit breaker: stop calling an instance that keeps failing, retry later."""

from __future__ import annotations

from collections.abc import Callable


class CircuitBreaker:
    """Closed until ``failure_threshold`` consecutive failures, then open for ``reset_after_s``;
    after that one trial call is let through (half-open) and its result closes or reopens it."""

    def __init__(
        self, clock: Callable[[], float], failure_threshold: int = 3, reset_after_s: float = 5.0
    ) -> None:
        self.clock = clock
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def available(self) -> bool:
        """Would :meth:`allow` let a call through now? (Does not consume the half-open trial.)"""
        if self._opened_at is None:
            return True
        return not self._trial_in_flight and self.clock() - self._opened_at >= self.reset_after_s

    def allow(self) -> bool:
        """May a call go out now? A half-open breaker admits one trial call at a time."""
        if self._opened_at is None:
            return True
        if self._trial_in_flight or self.clock() - self._opened_at < self.reset_after_s:
            return False
        self._trial_in_flight = True
        return True

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        self._trial_in_flight = False
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self._opened_at = self.clock()
