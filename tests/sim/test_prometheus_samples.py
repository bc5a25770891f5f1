"""Scraped samples: deltas, sums by label, histogram quantiles as Prometheus computes them."""

from __future__ import annotations

import pytest

from sim.measure import prometheus_samples as prom

BEFORE = """\
# TYPE lag_seconds histogram
lag_seconds_bucket{le="0.01",replica="a"} 5.0
lag_seconds_bucket{le="0.1",replica="a"} 5.0
lag_seconds_bucket{le="+Inf",replica="a"} 5.0
lag_seconds_count{replica="a"} 5.0
# TYPE fallback_total counter
fallback_total{reason="warming_up"} 2.0
"""
AFTER = """\
# TYPE lag_seconds histogram
lag_seconds_bucket{le="0.01",replica="a"} 85.0
lag_seconds_bucket{le="0.1",replica="a"} 100.0
lag_seconds_bucket{le="+Inf",replica="a"} 105.0
lag_seconds_count{replica="a"} 105.0
lag_seconds_bucket{le="0.01",replica="b"} 10.0
lag_seconds_bucket{le="0.1",replica="b"} 10.0
lag_seconds_bucket{le="+Inf",replica="b"} 10.0
# TYPE fallback_total counter
fallback_total{reason="warming_up"} 7.0
fallback_total{reason="timeout"} 1.0
"""


def test_deltas_and_sums_by_label() -> None:
    change = prom.delta(prom.parse(BEFORE), prom.parse(AFTER))
    assert prom.by_label(change, "fallback_total", "reason") == {"warming_up": 5.0, "timeout": 1.0}
    assert prom.total(change, "fallback_total") == 6.0
    assert prom.total(change, "lag_seconds_count", replica="a") == 100.0


def test_histogram_quantiles_and_shares() -> None:
    change = prom.delta(prom.parse(BEFORE), prom.parse(AFTER))
    buckets = prom.histogram(change, "lag_seconds")  # replicas a and b summed
    assert buckets == [(0.01, 90.0), (0.1, 105.0), (float("inf"), 110.0)]
    assert prom.quantile(buckets, 0.5) == pytest.approx(0.01 * 55 / 90)
    assert prom.quantile(buckets, 0.9) == pytest.approx(0.01 + 0.09 * (99 - 90) / 15)
    assert prom.quantile(buckets, 0.99) == 0.1  # in +Inf: the last finite bound
    assert prom.share_above(buckets, 0.01) == pytest.approx(20 / 110)
    assert prom.merge([buckets, buckets])[0] == (0.01, 180.0)
    assert prom.quantile([], 0.5) is None and prom.share_above([(float("inf"), 0.0)], 0.01) is None
    with pytest.raises(ValueError, match="not a bucket bound"):
        prom.share_above(buckets, 0.05)
