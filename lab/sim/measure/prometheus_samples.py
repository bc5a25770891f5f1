"""Prometheus text scraped from live processes: samples, deltas between scrapes, histogram quantiles."""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]
"""Sample value by (sample name, sorted labels)."""


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    return parse(response.text)


def delta(before: Samples, after: Samples) -> Samples:
    """What every sample of ``after`` gained since ``before`` (a sample new in ``after`` from 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    wanted = labels.items()
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= dict(ls).items())


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Samples called ``name`` summed by the value of ``label``."""
    out: dict[str, float] = {}
    for (n, labels), value in samples.items():
        if n == name and (key := dict(labels).get(label)) is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def histogram(samples: Samples, name: str) -> list[tuple[float, float]]:
    """Cumulative ``(upper bound, count)`` buckets of histogram ``name``, summed over its other
    labels, in bound order (``+Inf`` last)."""
    counts = by_label(samples, f"{name}_bucket", "le")
    return sorted((float(bound), count) for bound, count in counts.items())


def merge(histograms: Sequence[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The bucket-wise sum of histograms with the same bounds."""
    summed: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets:
            summed[bound] = summed.get(bound, 0.0) + count
    return sorted(summed.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's ``histogram_quantile``: linear within the bucket holding rank ``q``; the last
    finite bound when it falls in ``+Inf``; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def share_above(buckets: list[tuple[float, float]], bound: float) -> float | None:
    """Share of observations above ``bound`` (one of the histogram's bounds); None without any."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    at_most = next((count for b, count in buckets if b == bound), None)
    if at_most is None:
        raise ValueError(f"{bound} is not a bucket bound")
    return 1.0 - at_most / buckets[-1][1]
