"""Prediction drift: the EPP's own error on the endpoints it chose, and when to stop trusting it.

Each completed request gives, per target (``ttft``, ``tpot``), the chosen endpoint's predicted
latency and the measured one (the same actuals the request trains the model on). The
:class:`DriftMonitor` keeps the last ``window`` pairs per target and model version, for the
metrics, and per target whatever version predicted, for the rule; each gives a rolling MAPE
(mean |predicted − actual| / actual) and bias (mean (predicted − actual) / actual: positive
when the model predicts too slow).

The rule is judged on the live error per target over the last ``window`` requests, whichever
versions predicted them: the trainer publishes a version every few seconds, often before one
version has a full window of its own. The model drifts when some target's MAPE over a full
window is above ``threshold``. While it drifts, the predicted-latency producer still predicts
(so the error keeps being measured) but publishes no prediction: requests fall back to the
heuristics with the reason ``drift``, and the trainer is asked to retrain. Drift ends when
every target's MAPE over its window is at or below ``recover_threshold`` (the engines back to
their old speed, or newer versions trained on the new speed).

A target whose model is a constant (the trainer serves the median where its fitted model did not
beat it: decoding speed that barely varied over the training window) is measured but not judged,
and its live window is dropped until a fitted model serves it again. A constant predicts the
same latency on every endpoint (before any per-endpoint correction), so its error cannot
mislead the ranking that falling back would guard against; and under a load the training
window never saw (a saturated pool) its error passes the threshold while the fitted TTFT model
routes well. Pure: no I/O, and times come from the caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

TARGETS = ("ttft", "tpot")


@dataclass(frozen=True, slots=True)
class DriftRule:
    """The drift rule (see the module docstring); ``threshold`` 0 turns it off."""

    threshold: float = 0.5
    recover_threshold: float = 0.3
    window: int = 100


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Rolling error of one target under one model version."""

    target: str
    version: int
    samples: int
    mape: float
    bias: float


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """A change of the drift state, at ``at`` (the caller's clock)."""

    at: float
    drifting: bool
    version: int
    target: str
    mape: float


class _Window:
    __slots__ = ("abs_sum", "pairs", "signed_sum")

    def __init__(self, size: int) -> None:
        self.pairs: deque[float] = deque(maxlen=size)
        self.abs_sum = 0.0
        self.signed_sum = 0.0

    def add(self, relative_error: float) -> None:
        if len(self.pairs) == self.pairs.maxlen:
            old = self.pairs[0]
            self.abs_sum -= abs(old)
            self.signed_sum -= old
        self.pairs.append(relative_error)
        self.abs_sum += abs(relative_error)
        self.signed_sum += relative_error

    @property
    def full(self) -> bool:
        return len(self.pairs) == self.pairs.maxlen

    def stats(self, target: str, version: int) -> ErrorStats:
        n = max(len(self.pairs), 1)
        return ErrorStats(target, version, len(self.pairs), self.abs_sum / n, self.signed_sum / n)


class DriftMonitor:
    """Rolling prediction error per (target, model version) and per target, and the drift state.
    Keeps the per-version windows of the ``KEPT_VERSIONS`` newest versions only."""

    KEPT_VERSIONS = 3

    def __init__(self, rule: DriftRule) -> None:
        self.rule = rule
        self._windows: dict[tuple[str, int], _Window] = {}
        self._live: dict[str, _Window] = {}
        self.newest_version: int | None = None
        self.drifting = False
        self.events: list[DriftEvent] = []
        """Every change of state, oldest first (for reports and tests)."""
        self._retrain_due = False

    @property
    def enabled(self) -> bool:
        return self.rule.threshold > 0

    def observe(
        self,
        target: str,
        version: int,
        predicted_ms: float,
        actual_ms: float,
        now: float,
        constant: bool = False,
    ) -> None:
        """One measured request: ``target``'s prediction by model ``version`` and the actual;
        ``constant``: that version predicts ``target`` by a constant (measured, not judged)."""
        if actual_ms <= 0 or predicted_ms <= 0:
            return  # nothing measured, or a model that does not predict this target
        if self.newest_version is None or version > self.newest_version:
            self.newest_version = version
            for key in [k for k in self._windows if k[1] <= version - self.KEPT_VERSIONS]:
                del self._windows[key]
        window = self._windows.get((target, version))
        if window is None:
            window = self._windows[(target, version)] = _Window(self.rule.window)
        error = (predicted_ms - actual_ms) / actual_ms
        window.add(error)
        if constant:
            self._live.pop(target, None)
            return
        live = self._live.get(target)
        if live is None:
            live = self._live[target] = _Window(self.rule.window)
        live.add(error)
        if self.enabled:
            self._judge(target, live, version, now)

    def _judge(self, target: str, window: _Window, version: int, now: float) -> None:
        if not window.full:
            return
        mape = window.abs_sum / len(window.pairs)
        if not self.drifting and mape > self.rule.threshold:
            self.drifting = True
            self._retrain_due = True
            self.events.append(DriftEvent(now, True, version, target, mape))
            return
        if self.drifting and self._recovered():
            self.drifting = False
            self.events.append(DriftEvent(now, False, version, target, mape))

    def _recovered(self) -> bool:
        """Every judged target's live error is at or below the recovery threshold over a full
        window (a target the models do not predict, or predict by a constant, has no window)."""
        limit = self.rule.recover_threshold
        return all(w.full and w.abs_sum / len(w.pairs) <= limit for w in self._live.values())

    def take_retrain_request(self) -> bool:
        """True once per entry into drift: the caller asks the trainer to retrain."""
        due, self._retrain_due = self._retrain_due, False
        return due

    def stats(self) -> list[ErrorStats]:
        """The rolling error of every (target, version) held, newest version last."""
        return [w.stats(t, v) for (t, v), w in sorted(self._windows.items(), key=lambda kv: kv[0][1])]
