"""The in-flight benchmark's arithmetic and its per-thread CPU reading."""

from __future__ import annotations

import os
import threading

import pytest

from bench.harness.process_cpu import task_cpu_seconds
from bench.runs.inflight_cost import InflightSettings, measure_bare_grpc, net_figures, thread_cpu_seconds


def test_net_figures_take_the_idle_rate_over_the_wall_time_off():
    figures = net_figures(cpu_s=0.5, wall_s=10.0, idle_rate=0.02, tokens=1500, chunks=1000)
    assert figures["net_ms"] == pytest.approx(300.0)
    assert figures["net_us_per_token"] == pytest.approx(200.0)
    assert figures["net_us_per_chunk"] == pytest.approx(300.0)
    assert figures["net_ms_per_s_in_flight"] == pytest.approx(30.0)


def test_net_figures_of_a_response_without_chunks_have_no_per_chunk_cost():
    figures = net_figures(cpu_s=0.2, wall_s=10.0, idle_rate=0.02, tokens=100, chunks=0)
    assert figures["net_us_per_chunk"] == 0.0


def test_thread_cpu_by_name_adds_up_to_the_process_cpu():
    done = threading.Event()
    worker = threading.Thread(target=lambda: done.wait(5))
    worker.start()
    try:
        sum(i * i for i in range(300_000))  # some CPU on the main thread
        by_name = thread_cpu_seconds(os.getpid())
        total = task_cpu_seconds(os.getpid())
    finally:
        done.set()
        worker.join()
    assert by_name and all(name for name in by_name)
    assert sum(by_name.values()) == pytest.approx(total, rel=0.05)
    assert sum(by_name.values()) > 0.0


def test_the_bare_grpc_servicer_answers_every_message_and_its_cpu_is_read():
    rows = measure_bare_grpc(InflightSettings(bare_messages=20, pace_ms=(0.0, 1.0)))
    assert [row["pace_ms"] for row in rows] == [0.0, 1.0]
    assert all(row["us_per_message"] > 0 for row in rows)
    assert rows[1]["wall_s"] >= 20 * 1e-3  # paced: at least the 20 pauses
