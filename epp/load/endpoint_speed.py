"""Each endpoint's speed relative to the pool's, measured from its own requests' decode steps.

A pool that mixes accelerators or serving configs holds endpoints that do the same work at
different speeds, and token load counted in tokens calls a slow endpoint with 1,000 tokens in
flight as busy as a fast one with 1,000. What the EPP sees of an endpoint's speed is its
requests' time per output token (TPOT): one decode step, which every sequence in the batch
shares. A step also lengthens with what runs beside it: the batch, and above all the prompt tokens
prefilled in the same step (chunked prefill). So an endpoint that gets more traffic looks slower
than it is; TPOT is compared only between requests that decoded under the same conditions.

Conditions, over a request's decode (first token to last), from what the EPP routed
(:class:`DecodeCounts`): the mean number of requests booked on its endpoint (the batch) and the
uncached prompt tokens of the requests whose prefill finished there meanwhile, per decode step.
Both describe the steps themselves: a slow engine that holds more requests, or fits more prompt
tokens into each of its fewer steps, is compared with fast ones whose steps held as much. (The
share of the time a prompt was prefilling is no such condition: a slow engine prefills longer,
so it would read as "busier" and its slowness would be explained away.) Model, per completed
request r on endpoint e under conditions c::

    log TPOT_r = s_e + g_c + noise

``g_c`` is the step time under conditions c (bins: the batch in powers of two, 1, 2-3, 4-7, ...
128+, times the prefilled tokens per step in powers of two from 32, under 32, 32-63, ...
2,048+) and ``s_e`` the endpoint's log slowness. Each (endpoint,
bin) keeps the exponentially weighted mean of its requests' log TPOT (weight
``1 - 2^(-1/half_life)`` per request, so a speed that changes is followed); ``s`` and ``g`` are
fitted to those means by alternating weighted means (backfitting), each cell weighted by its
requests, up to ``half_life``. ``s`` is centred on the endpoints' mean, so
:meth:`EndpointSpeeds.slowness` is each endpoint's step time over the pool's typical one under
the same conditions, in steps of 10%: about 2.5 times the fast ones' for an engine 2.5 times
slower, 1 for an endpoint not yet measured, exactly 1 everywhere in a homogeneous pool whose
endpoints measure within 5% of each other.

Assumed: an endpoint slower at decoding is as much slower at prefill (true of a slower
accelerator to first order; a serving config that only limits the batch shows up in the batch,
not here). Pure state: the caller passes the time; no I/O. The fit is redone lazily, every
``refit_every`` requests or once per endpoint's worth of requests, whichever is rarer, starting
from the last.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

BATCH_BINS = 8
"""Batch bins: 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64-127, 128 and more."""

PREFILL_BIN_TOKENS = 32
PREFILL_BINS = 8
"""Prompt tokens prefilled per decode step: under 32, 32-63, 64-127, ..., 2,048 and more."""

BACKFIT_ROUNDS = 2
"""Rounds per refit; each refit starts from the last fit, so the fit converges across refits."""

SLOWNESS_STEP = math.log(1.1)
"""Slowness is reported in steps of 10%: a homogeneous pool's measurement noise (within a few
percent of 1) reads exactly 1 and changes no decision, and a slow endpoint is off by 5% at most."""

FORGET_AFTER = 50_000
"""An endpoint without a request in this many is forgotten (gone from the pool, most likely), so
the state stays bounded while pods come and go."""

K = TypeVar("K", bound=Hashable)


class DecodeConditions(NamedTuple):
    """What a request's decode steps ran beside, on average."""

    batch: float
    """Requests booked on its endpoint (itself included)."""
    prefill_per_step: float
    """Prompt tokens prefilled there per decode step (chunked prefill shares the steps)."""

    def bin(self) -> tuple[int, int]:
        batch = min(max(1, round(self.batch)).bit_length() - 1, BATCH_BINS - 1)
        prefill = min(max(0, int(self.prefill_per_step) // PREFILL_BIN_TOKENS).bit_length(), PREFILL_BINS - 1)
        return batch, prefill


class DecodeMark(NamedTuple):
    """Where a request's decode began on its endpoint: the time and the counts then."""

    at: float
    request_seconds: float
    prefilled_tokens: int


@dataclass(slots=True)
class _Counts:
    at: float
    requests: int
    request_seconds: float = 0.0
    prefilled_tokens: int = 0

    def request_seconds_at(self, now: float) -> float:
        """Request-seconds up to ``now``, the last level held since."""
        return self.request_seconds + self.requests * max(0.0, now - self.at)


class DecodeCounts:
    """Per endpoint: the time integral of its booked requests (from the levels the caller samples
    each time it reads the endpoint's token load; a level holds until the next sample) and the
    prompt tokens prefilled there (counted at each request's first token)."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, _Counts] = {}

    def _counts(self, endpoint: str, now: float) -> _Counts:
        counts = self._by_endpoint.get(endpoint)
        if counts is None:
            counts = self._by_endpoint[endpoint] = _Counts(now, 0)
        return counts

    def sample(self, endpoint: str, now: float, requests: int) -> None:
        counts = self._counts(endpoint, now)
        counts.request_seconds = counts.request_seconds_at(now)
        counts.at, counts.requests = max(counts.at, now), requests

    def prefilled(self, endpoint: str, now: float, tokens: int) -> None:
        """A request's ``tokens`` uncached prompt tokens were prefilled on ``endpoint``."""
        self._counts(endpoint, now).prefilled_tokens += tokens

    def mark(self, endpoint: str, now: float) -> DecodeMark:
        """A mark to measure a decode from."""
        counts = self._counts(endpoint, now)
        return DecodeMark(now, counts.request_seconds_at(now), counts.prefilled_tokens)

    def since(self, endpoint: str, mark: DecodeMark, now: float, steps: int) -> DecodeConditions | None:
        """The mean batch on ``endpoint`` from ``mark`` to ``now``, and the prompt tokens
        prefilled there per step of a decode of ``steps`` steps (None if no time or step passed)."""
        elapsed = now - mark.at
        if elapsed <= 0 or steps < 1:
            return None
        current = self.mark(endpoint, now)
        return DecodeConditions(
            (current.request_seconds - mark.request_seconds) / elapsed,
            (current.prefilled_tokens - mark.prefilled_tokens) / steps,
        )

    def forget(self, endpoints: Iterable[str]) -> None:
        for endpoint in endpoints:
            self._by_endpoint.pop(endpoint, None)


class EndpointSpeeds:
    """Per endpoint: its step time relative to the pool's under the same conditions (see the module)."""

    def __init__(self, half_life: float = 20.0, refit_every: int = 8) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        if refit_every < 1:
            raise ValueError("refit_every must be at least 1")
        self.half_life = half_life
        self.weight = 1.0 - 2.0 ** (-1.0 / half_life)
        self.refit_every = refit_every
        self._cells: dict[str, dict[tuple[int, int], list[float]]] = {}
        """Per endpoint and bin: [mean log TPOT, requests]."""
        self._log_slowness: dict[str, float] = {}
        self._rounded: dict[str, float] = {}
        self._unfitted = 0
        self._observed = 0
        self._last_seen: dict[str, int] = {}
        self.counts = DecodeCounts()
        """What the caller reports of each endpoint's load, to find each decode's conditions."""

    def decode_finished(
        self, endpoint: str, started: DecodeMark, now: float, output_tokens: int, tpot_s: float
    ) -> None:
        """The request whose decode began at ``started`` (``counts.mark`` at its first token)
        ended at ``now``, ``output_tokens`` generated at ``tpot_s``."""
        conditions = self.counts.since(endpoint, started, now, output_tokens - 1)
        if conditions is not None:
            self.observe(endpoint, conditions, tpot_s)

    def observe(self, endpoint: str, conditions: DecodeConditions, tpot_s: float) -> None:
        """A request on ``endpoint`` decoded at ``tpot_s`` under ``conditions``."""
        if not tpot_s > 0 or not math.isfinite(tpot_s):
            return
        cell = self._cells.setdefault(endpoint, {}).setdefault(conditions.bin(), [0.0, 0.0])
        value = math.log(tpot_s)
        cell[0] = value if cell[1] == 0 else cell[0] + self.weight * (value - cell[0])
        cell[1] += 1
        self._observed += 1
        self._last_seen[endpoint] = self._observed
        self._unfitted += 1
        if self._unfitted >= max(self.refit_every, len(self._cells)) or endpoint not in self._log_slowness:
            self._fit()

    def slowness(self, endpoint: str) -> float:
        """``endpoint``'s step time over the pool's typical one, in steps of ``SLOWNESS_STEP`` (1
        until it has been measured)."""
        return self._rounded.get(endpoint, 1.0)

    def measured_slowness(self, endpoint: str) -> float:
        """The same, unrounded."""
        return math.exp(self._log_slowness.get(endpoint, 0.0))

    def _forget_quiet(self) -> None:
        gone = [e for e, seen in self._last_seen.items() if self._observed - seen > FORGET_AFTER]
        for endpoint in gone:
            del self._cells[endpoint], self._last_seen[endpoint]
        self.counts.forget(gone)

    def _fit(self) -> None:
        self._unfitted = 0
        self._forget_quiet()
        cap = self.half_life
        cells = [
            (e, b, mean, min(count, cap))
            for e, bins in self._cells.items()
            for b, (mean, count) in bins.items()
        ]
        s = {e: self._log_slowness.get(e, 0.0) for e in self._cells}
        for _ in range(BACKFIT_ROUNDS):
            g = _weighted_means((b, m - s[e], w) for e, b, m, w in cells)
            by_endpoint = _weighted_means((e, m - g[b], w) for e, b, m, w in cells)
            centre = sum(by_endpoint.values()) / len(by_endpoint)
            s = {e: v - centre for e, v in by_endpoint.items()}
        self._log_slowness = s
        self._rounded = {e: math.exp(round(v / SLOWNESS_STEP) * SLOWNESS_STEP) for e, v in s.items()}


def _weighted_means(rows: Iterable[tuple[K, float, float]]) -> dict[K, float]:
    """The weighted mean of each key's values, from (key, value, weight) rows."""
    total: dict[K, float] = {}
    weight: dict[K, float] = {}
    for key, value, w in rows:
        total[key] = total.get(key, 0.0) + value * w
        weight[key] = weight.get(key, 0.0) + w
    return {k: total[k] / weight[k] for k in total}
