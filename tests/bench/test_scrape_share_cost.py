"""``llm-epp-bench scrape-share``'s in-process apply cost and its report (the live part starts
Envoy, nats-server and EPPs: it is the benchmark itself)."""

from __future__ import annotations

import pytest

from bench.cli import BENCHMARKS
from bench.runs import scrape_share_cost


def test_the_apply_cost_splits_a_message_into_its_figures_and_the_rest() -> None:
    measured = scrape_share_cost.measure_share_apply_us(endpoints=20, messages=20)
    assert measured["every_endpoint_us"] > measured["one_endpoint_us"] > 0
    assert measured["figure_us"] > 0
    assert measured["one_endpoint_us"] == pytest.approx(measured["figure_us"] + measured["message_us"])


def test_the_report_shows_each_replica_and_the_apply_cost() -> None:
    replica = {"ms_per_s": 60.0, "published_per_s": 1000.0, "applied_per_s": 1000.0, "fallback_per_s": 0.5}
    data = {
        "machine": {"cpus": 2, "date": "2026-12-04"},
        "settings": {"endpoints": 100, "idle_s": 10.0, "settle_s": 3.0},
        "results": [
            {
                "replicas": 2,
                "share": True,
                "mean_ms_per_s": 60.0,
                "per_replica": [replica, replica],
                "load_1m_before": 1.5,
            }
        ],
        "one_replica": [
            {
                "replicas": 2,
                "ms_per_s": 125.0,
                "scrapes_per_s": 944.0,
                "applied_per_s": 1025.0,
                "owned": 54,
                "alone_on_owned_ms_per_s": 110.0,
                "load_1m_before": 3.1,
            }
        ],
        "apply": {"figure_us": 2.2, "message_us": 3.0, "every_endpoint_us": 223.0},
    }
    report = scrape_share_cost._markdown(data)
    assert "| 2 | on | 60.0 | 60 / 60 | 1000 / 1000 | 1000 / 1000 | 0.5 / 0.5 | 1.50 |" in report
    assert "2.20 µs per endpoint figure" in report
    assert "| 2 | 125.0 | 944 | 1025 | 54 | 110.0 | 3.10 |" in report
    assert BENCHMARKS["scrape-share"] is scrape_share_cost.run
