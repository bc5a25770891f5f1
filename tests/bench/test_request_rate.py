"""The request-rate bench's open-loop driver and report (the measuring itself is timed: run
``llm-epp-bench request-rate``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from bench.runs import request_rate
from bench.runs.request_rate import RequestRateSettings, _drive, cpu_shares, thread_names


@pytest.fixture
async def sse_server() -> AsyncIterator[tuple[str, list[tuple[dict, str | None]]]]:
    received: list[tuple[dict, str | None]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        received.append((await request.json(), request.headers.get("x-slo-ttft-ms")))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1/chat/completions", received
    await runner.cleanup()


async def test_the_driver_sends_rate_times_seconds_streamed_requests_each_its_own_prompt(sse_server) -> None:
    url, received = sse_server
    settings = RequestRateSettings(output_tokens=3, prompt_words=5, slo_every=4)
    ttfts = await _drive(url, 40.0, 0.5, settings, first=100)
    assert len(ttfts) == len(received) == 20 and all(t > 0 for t in ttfts)
    bodies = [body for body, _ in received]
    assert all(b["stream"] and b["max_tokens"] == 3 for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 20
    assert sum(slo is not None for _, slo in received) == 5  # requests 100, 104, ... 116


def test_the_report_gives_each_rates_cost(tmp_path: Path, monkeypatch) -> None:
    cell = {
        "achieved_rate": 49.5,
        "envoy_us": 900.0,
        "epp_cores": 0.1,
        "messages_to_epp": 4.2,
        "messages_from_epp": 3.5,
        "ttft_p50_ms": 9.0,
        "ttft_p99_ms": 20.0,
    }
    measured = {
        "idle_ms_per_s": 2.0,
        "cells": [{**cell, "callout": "ext-proc", "tokenizer": "estimate", "rate": 50.0, "epp_us": 1_234.0}],
    }
    monkeypatch.setattr(request_rate, "measure", lambda settings, profile_path: measured)
    request_rate.run(tmp_path, RequestRateSettings(rates=(50.0,)))
    report = (tmp_path / "request_rate.md").read_text()
    assert "| ext-proc | estimate | 50 | 49.5 | 1234 | 900 | 0.10 | 4.20 / 3.50 | 9.0 / 20.0 |" in report
    assert json.loads((tmp_path / "request_rate.json").read_text())["cells"][0]["epp_us"] == 1_234.0


def test_each_sampled_stack_of_the_main_thread_counts_in_the_first_share_it_belongs_to() -> None:
    raw = "\n".join(
        [
            "thread (1): Thread-1 (_poll_wrapper);Thread.run (threading.py:982) 20",
            "thread (2): MainThread;main (epp/main.py:3);Runner.run (asyncio/runners.py:118) 40",
            "thread (2): MainThread;Runner.run (asyncio/runners.py:118);encode (epp/tokenizer/model.py:9) 15",
            "thread (2): MainThread;Runner.run (asyncio/runners.py:118);schedule (epp/director.py:5) 25",
        ]
    )
    assert list(cpu_shares(raw).values()) == [0.1875, 0.5, 0.3125]  # the main thread's 80 samples


def test_py_spys_thread_frames_name_the_kernels_thread_ids() -> None:
    raw = "thread (12): MainThread;main (a.py:1) 3\nthread (13): Thread-1 (_poll_wrapper);run (b.py:2) 1\n"
    assert thread_names(raw) == {12: "MainThread", 13: "Thread-1 (_poll_wrapper)"}
