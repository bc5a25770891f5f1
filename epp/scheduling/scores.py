"""Score normalisation shared by scorers (every score lies in [0, 1], higher is better)."""

from __future__ import annotations

from collections.abc import Sequence


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """Map the smallest value to 1 and the largest to 0, linearly; all 1.0 if they are equal."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]
