"""The capacity plan's arithmetic, its inputs' construction and its report (the measuring itself
is timed: run ``llm-epp-bench capacity``)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage

from bench.runs import capacity
from bench.runs.capacity import (
    CapacitySettings,
    UnitCosts,
    access_log_batch,
    llm_d_epp_cores,
    plan,
    replica_cores,
    replica_overhead,
    request_cores,
    sync_messages_per_s,
    sync_totals_per_s,
)
from epp.extproc.access_log import log_entry
from epp.sync.messages import decode

FREE = UnitCosts(
    request_us=0.0,
    chunk_us=0.0,
    log_entry_us=0.0,
    scrape_us=0.0,
    sync_message_us=0.0,
    sync_total_us=0.0,
    row_us=0.0,
    progress_us=0.0,
    share_apply_us=0.0,
)


def test_requests_cost_their_own_work_and_the_sampled_streams_chunks() -> None:
    costs = replace(FREE, request_us=1_000.0, chunk_us=100.0)
    s = CapacitySettings(output_tokens=500, sample_every=100, callout="ext-proc")
    # 1,000 µs + 100 µs × 500 chunks / 100 = 1,500 µs a request
    assert request_cores(costs, s, 1_000) == pytest.approx(1.5)
    assert request_cores(costs, replace(s, sample_every=1), 1_000) == pytest.approx(51.0)
    # Over ext_authz no stream is read chunk by chunk.
    assert request_cores(costs, replace(s, callout="ext-authz"), 1_000) == pytest.approx(1.0)


def test_a_handed_off_stream_pays_for_its_progress_once_a_second_while_in_flight() -> None:
    costs = replace(FREE, request_us=1_000.0, progress_us=4.0)
    # 1,000 µs + 4 µs × 5 s in flight × once a second = 1,020 µs a request
    assert request_cores(costs, CapacitySettings(answer_s=5.0), 1_000) == pytest.approx(1.02)


def test_sync_messages_are_one_take_per_publish_interval_at_most_plus_heartbeats() -> None:
    s = CapacitySettings()
    assert sync_messages_per_s(s, 10_000, 1) == 0.0  # no peers, nothing published
    assert sync_messages_per_s(s, 10_000, 4) == pytest.approx(200 + 2)
    # 30 requests/s a replica: 90 events, the 20 ticks and the progress estimate, each its own take
    assert sync_messages_per_s(s, 60, 2) == pytest.approx(90 + 20 + 1 + 2)


def test_sync_totals_are_each_event_the_metered_streams_at_each_tick_and_the_estimates() -> None:
    s = CapacitySettings(pods=100, answer_s=5.0, sample_every=100)
    assert sync_totals_per_s(s, 10_000, 1) == 0.0
    # 500 requests/s a replica: 1,500 events; 2,500 in flight, 25 of them metered in full, so
    # 25 pods at each of 20 ticks; every pod's estimate once a second
    assert sync_totals_per_s(s, 1_000, 2) == pytest.approx(1_500 + 25 * 20 + 100)
    assert sync_totals_per_s(s, 1_000, 20) == pytest.approx(150 + 2.5 * 20 + 100)
    assert sync_totals_per_s(s, 1_000_000, 2) == pytest.approx(100 * 200)  # every pod, every take


def test_unshared_each_replica_scrapes_every_pod_and_reads_its_peers_log_entries() -> None:
    costs = replace(FREE, scrape_us=500.0, log_entry_us=10.0, sync_message_us=4.0, sync_total_us=2.0)
    s = CapacitySettings(pods=100, share_scrapes=False, own_log_entries=False)
    one = replica_overhead(costs, s, 10_000, 1, 0.05)
    assert one == pytest.approx({"scrapes": 100 * 20 * 500e-6, "sync": 0.0, "access_log": 0.0})
    four = replica_overhead(costs, s, 10_000, 4, 0.2)
    assert four["scrapes"] == pytest.approx(100 * 5 * 500e-6)
    assert four["access_log"] == pytest.approx(10_000 * 3 / 4 * 10e-6)
    per_peer_us = sync_messages_per_s(s, 10_000, 4) * 4.0 + sync_totals_per_s(s, 10_000, 4) * 2.0
    assert four["sync"] == pytest.approx(3 * per_peer_us / 1e6)
    # Logged to their own replica only, the peers' entries cost nothing.
    assert replica_overhead(costs, replace(s, own_log_entries=True), 10_000, 4, 0.2)["access_log"] == 0.0


def test_the_plan_takes_the_fewest_replicas_whose_cores_stay_within_the_utilisation() -> None:
    s = CapacitySettings(output_tokens=0, utilisation=0.7, own_log_entries=False)
    costs = replace(FREE, request_us=350.0)  # 3.5 cores at 10,000 QPS: 5 replicas at 70%
    result = plan(costs, s, 10_000, 0.05)
    assert result["fits"] and result["replicas"] == 5 and result["epp_cores"] == pytest.approx(3.5)
    # Each replica now also reads its peers' log entries: 0.07 cores at 5, so 6 are needed.
    costs = replace(costs, log_entry_us=10.0)
    result = plan(costs, s, 10_000, 0.05)
    overhead = sum(replica_overhead(costs, s, 10_000, 5, 0.05).values())
    assert 3.5 / 5 + overhead > 0.7
    assert result["replicas"] == 6
    assert result["epp_cores"] == pytest.approx(
        3.5 + 6 * sum(replica_overhead(costs, s, 10_000, 6, 0.05).values())
    )
    # each: 200 takes, 2 heartbeats, 20 shared scrapes a second
    assert result["nats_published_per_s"] == pytest.approx(6 * 222)
    assert result["nats_delivered_per_s"] == pytest.approx(6 * 222 * 5)


def test_when_no_replica_count_fits_the_plan_gives_the_least_loaded_one() -> None:
    s = CapacitySettings(pods=100, utilisation=0.7, share_scrapes=False)
    costs = replace(FREE, request_us=100.0, scrape_us=400.0)  # 0.8 cores at 20 scrapes/s a pod
    fast = plan(costs, s, 1_000, 0.05)
    assert not fast["fits"] and fast["replicas"] == 2_000  # more replicas, a smaller share each
    assert fast["replica_cores"] == pytest.approx(0.8 + 0.1 / 2_000)
    assert plan(costs, s, 1_000, 0.2)["fits"] and plan(costs, s, 1_000, 0.2)["replicas"] == 1
    # Sync grows with the peers: past some count, more replicas load each one more.
    # 10 cores of requests; 202 messages a second from each peer at 500 µs: 0.1 core a peer.
    costs = replace(costs, request_us=1_000.0, sync_message_us=500.0)
    busy = plan(costs, s, 10_000, 1.0)
    assert not busy["fits"] and busy["replicas"] == 10  # 10 / K + 0.1 (K - 1) is least at 10
    assert busy["replica_cores"] == pytest.approx(
        min(replica_cores(costs, s, 10_000, k, 1.0) for k in range(1, 2_001))
    )


def test_predictor_servers_serve_every_pods_row_of_every_predicted_request() -> None:
    s = CapacitySettings(pods=100, rows_per_prediction=100, utilisation=0.7)
    costs = replace(FREE, row_us=10.0)  # 1,000 QPS × 100 rows × 10 µs = 1 core
    assert plan(costs, s, 1_000, 0.2)["predictor_servers"] == math.ceil(1 / 0.7)
    assert plan(costs, replace(s, predicted_share=0.5), 1_000, 0.2)["predictor_servers"] == 1


def test_llm_ds_figures_give_about_200_cores_at_10k_qps_of_500_tokens() -> None:
    assert pytest.approx(4_100) == capacity.LLM_D_REQUEST_US
    assert llm_d_epp_cores(10_000, 500) == pytest.approx(196)
    assert plan(FREE, CapacitySettings(), 10_000, 0.05)["llm_d_predictor_servers"] == 4
    assert plan(FREE, CapacitySettings(), 5_000, 0.05)["llm_d_predictor_servers"] is None


def test_the_access_log_batch_reads_as_finished_answers_under_the_forwarded_ids() -> None:
    message = StreamAccessLogsMessage.FromString(access_log_batch(3, start=7))
    entries = [log_entry(e) for e in message.http_logs.log_entry]
    assert [e.request_id[:8] for e in entries] == ["00000007", "00000008", "00000009"]
    assert all(e.completed and not e.intermediate and e.response_bytes == 65_000 for e in entries)


def test_a_sync_message_carries_the_totals_of_the_endpoints_whose_progress_moved() -> None:
    wire = capacity._sync_messages(pods=10, bookings=2, messages=3, endpoints_each=4)
    assert len(wire) == 4  # the first (every booking routed), then one a tick
    assert len(decode(wire[0]).body) == 10 and [len(decode(w).body) for w in wire[1:]] == [4, 4, 4]


def test_the_report_has_the_unit_costs_the_plans_and_llm_ds_sources(tmp_path: Path, monkeypatch) -> None:
    costs = UnitCosts(
        request_us=1_000.0,
        chunk_us=150.0,
        log_entry_us=6.0,
        scrape_us=500.0,
        sync_message_us=3.0,
        sync_total_us=3.0,
        row_us=6.0,
        progress_us=2.0,
        share_apply_us=3.0,
    )
    cell = {"tokens": 500, "chunks": 502.0, "window_s": 15.0}
    rate = {"achieved_rate": 149.0, "envoy_us": 900.0, "ttft_p50_ms": 9.0, "ttft_p99_ms": 20.0}
    measured = {
        "request_us": [
            {"callout": "ext-proc", "tokenizer": "dir", "us": 1_000.0},
            {"callout": "ext-authz", "tokenizer": "dir", "us": 700.0},
            {"callout": "ext-authz", "tokenizer": "sampled", "us": 450.0},
            {"callout": "ext-authz", "tokenizer": "estimate", "us": 400.0},
        ],
        "rates": {
            "cells": [
                {**rate, "callout": "ext-proc", "tokenizer": "dir", "rate": 50.0, "epp_us": 1_400.0},
                {**rate, "callout": "ext-proc", "tokenizer": "dir", "rate": 150.0, "epp_us": 1_000.0},
            ]
        },
        "streams": {
            "cells": {
                "full": {**cell, "epp_ms": 77.0, "envoy_ms": 47.0},
                "first-token": {**cell, "epp_ms": 1.3, "envoy_ms": 36.0},
            }
        },
        "handler_us_by_endpoints": {"4": 400.0, "100": 1_100.0},
    }
    monkeypatch.setattr(capacity, "measure", lambda settings: (costs, measured))
    data = capacity.run(tmp_path, CapacitySettings(sample_every=100, share_scrapes=False, callout="ext-proc"))
    report = (tmp_path / "capacity.md").read_text()
    assert "| metered chunk (full metering) | 150.0 | 24–31 |" in report
    # 100 pods × 20/s × 500 µs: a core per replica for the scrapes alone; 1,000 µs a request,
    # 750 of sampled chunks, 10 of progress
    assert "| 10,000 | 50 ms | 17.6 | – | none fits (best: " in report
    ten_k = next(p for p in data["plans"] if p["qps"] == 10_000 and p["scrape_interval_s"] == 0.2)
    assert ten_k["fits"]
    assert f"| 10,000 | 200 ms | 17.6 | {ten_k['epp_cores']:.1f} | {ten_k['replicas']} |" in report
    assert "high_qps_small_token_comparison_analysis.md" in report
    assert "Routing over 100 endpoints instead of 4 adds 700 µs" in report
    assert "ext-proc (tokenizer: the model's) at 150 requests/s (achieved 149): 1,000 µs of EPP CPU" in report
    # Each callout's plan at the fast tick: ext_authz's requests cost 700 µs and read no chunk.
    authz = [p for p in data["callout_plans"] if p["callout"] == "ext-authz" and p["qps"] == 10_000]
    assert [p["tokenizer"] for p in authz] == ["dir", "sampled", "estimate"]
    assert authz[0]["request_cores"] == pytest.approx(10_000 * (700 + 2.0 * 5) / 1e6)
    assert authz[2]["request_cores"] == pytest.approx(10_000 * (400 + 2.0 * 5) / 1e6)
    assert "| ext-authz | the model's | 700 | 10,000 |" in report
    assert "| ext-authz | the model's on 1 prompt in 16 | 450 | 10,000 |" in report
    assert "| ext-authz | estimated counts | 400 | 10,000 |" in report
    assert "| decode progress of a handed-off stream moved on (once a second) | 2.00 | – |" in report
    assert (tmp_path / data["plot"]).stat().st_size > 0 and (tmp_path / "capacity.json").exists()


def test_with_shared_scrapes_a_replica_scrapes_its_share_of_the_pods_and_applies_the_rest() -> None:
    costs = replace(FREE, scrape_us=400.0, share_apply_us=3.0)
    s = CapacitySettings(pods=100)
    # 4 replicas at the 50 ms tick: 25 pods scraped (25 × 20 × 400 µs = 0.2 cores) and 75 applied
    # (75 × 20 × 3 µs = 4.5 ms/s); unshared, every pod scraped: 0.8 cores
    shared = replica_overhead(costs, s, 1_000, 4, 0.05)["scrapes"]
    assert shared == pytest.approx(0.2 + 0.0045)
    assert replica_overhead(costs, replace(s, share_scrapes=False), 1_000, 4, 0.05)[
        "scrapes"
    ] == pytest.approx(0.8)
    assert replica_overhead(costs, s, 1_000, 1, 0.05)["scrapes"] == pytest.approx(0.8)  # alone: all its own
    shared_plan = plan(costs, s, 1_000, 0.05)  # two replicas: 0.4 + 1.5 ms/s + 0.05 of requests each
    replicas = shared_plan["replicas"]
    assert replicas == 2
    each = sync_messages_per_s(s, 1_000, replicas) + 20  # takes, heartbeats, a scrape message a tick
    assert shared_plan["nats_published_per_s"] == pytest.approx(replicas * each)
