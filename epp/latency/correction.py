"""Per-endpoint corrections of the latency model, learned online from each endpoint's own samples.

The model sees an endpoint only through its load (queue, batch, KV usage, tokens in flight): two
endpoints with the same load get the same prediction, so in a pool that mixes accelerators or
serving configs it predicts the pool's average speed, too slow for the fast endpoints and too
fast for the slow ones. Nothing needs to label the endpoints: each completed request that was
predicted tells how far off the model was on the endpoint that served it. An endpoint's bias is
the exponentially weighted mean of log(actual / predicted) there, per target (TTFT, TPOT): it
starts at 0 (the model as is) and moves toward the endpoint's error with weight
``1 - 2^(-1/half_life)`` per sample. Its correction is that bias less the mean bias over the
samples seen (each endpoint's bias weighted by its sample count): the model was fitted to the
pool's samples, so over them it is unbiased, and what they share anyway is the model gone
stale between two retrains, the model's to fix and the drift monitor's to catch; corrected here
it would be chased twice, and in a homogeneous pool it would turn the noise of each endpoint's
few predicted requests into error. What remains is how each endpoint differs from the mix the
model learned (a slow replica's positive bias, the fast ones' negative one).
Predictions for the endpoint are multiplied by exp(correction), so a replica 2.5 times slower
than its peers is corrected within a few ``half_life``s of its own predicted requests, and one
whose speed changes is followed at that pace.

Pure state: the producer feeds it the raw predictions and the actuals; no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Literal

Target = Literal["ttft", "tpot"]

MAX_LOG_CORRECTION = math.log(20.0)
"""Corrections are clipped to a factor of 20 either way: one absurd sample cannot blow them up."""


class EndpointCorrections:
    """Per endpoint and target: the weighted mean log ratio of actual to raw predicted latency."""

    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self.weight = 1.0 - 2.0 ** (-1.0 / half_life)
        self._log_ratio: dict[tuple[str, Target], float] = {}
        self._samples: dict[tuple[str, Target], int] = {}
        self._weighted_total: dict[Target, float] = {"ttft": 0.0, "tpot": 0.0}
        self._sample_total: dict[Target, int] = {"ttft": 0, "tpot": 0}

    def factor(self, endpoint: str, target: Target) -> float:
        """What to multiply the model's ``target`` prediction for ``endpoint`` by: its bias less
        the sample-weighted mean bias (1 for an endpoint without samples, or while none has one)."""
        bias = self._log_ratio.get((endpoint, target))
        if bias is None:
            return 1.0
        return math.exp(bias - self._weighted_total[target] / self._sample_total[target])

    def observe(self, endpoint: str, target: Target, raw_predicted_ms: float, actual_ms: float) -> None:
        """``endpoint`` took ``actual_ms`` where the model (uncorrected) said ``raw_predicted_ms``."""
        if raw_predicted_ms <= 0 or actual_ms <= 0:
            return  # nothing predicted (no model for the target) or nothing measured
        ratio = max(-MAX_LOG_CORRECTION, min(MAX_LOG_CORRECTION, math.log(actual_ms / raw_predicted_ms)))
        key = (endpoint, target)
        current = self._log_ratio.get(key, 0.0)
        samples = self._samples.get(key, 0)
        updated = current + self.weight * (ratio - current)
        self._log_ratio[key] = updated
        self._samples[key] = samples + 1
        self._weighted_total[target] += (samples + 1) * updated - samples * current
        self._sample_total[target] += 1
