"""The live replay's per-config summary, from results and metrics made up here (no stack)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.runs.live_replay import RequestResult, Snapshot, rounds_table, sample_load, summarize


def result(sent_s: float, fallback: str | None, error: str | None = None) -> RequestResult:
    r = RequestResult("s", 0, sent_s, 10, sent_s=sent_s, end_s=sent_s + 1.0, status=200, error=error)
    r.fallback = fallback
    if error is None:
        r.ttft_s, r.e2e_s, r.prompt_tokens, r.cached_tokens, r.completion_tokens = 0.1, 1.0, 10, 0, 1
    return r


def snapshot(requests: float, warming_up: float) -> Snapshot:
    epp = {
        ("inference_objective_request_total", (("model_name", "tiny"),)): requests,
        ("llm_epp_prediction_fallback_total", (("reason", "warming_up"),)): warming_up,
    }
    return Snapshot({"epp": 0.0}, epp, [])


def test_the_first_request_routed_on_predictions_is_found_from_the_debug_headers() -> None:
    results = [
        result(0.5, "warming_up"),
        result(3.0, None, error="HTTP 500: boom"),  # failed: not evidence of a prediction
        result(4.0, "warming_up"),
        result(7.5, None),
        result(9.0, None),
    ]
    summary = summarize("p", True, results, snapshot(0, 0), snapshot(5, 2), 10.0, 1.0)
    assert summary["epp"]["first_predicted_s"] == 7.5
    assert summary["epp"]["predicted_share"] == 0.6
    assert [r["fallback"] for r in summary["records"]][:2] == ["warming_up", None]


def test_configs_without_predictions_have_no_first_predicted_request() -> None:
    summary = summarize("g", False, [result(1.0, None)], snapshot(0, 0), snapshot(1, 0), 2.0, 1.0)
    assert summary["epp"]["first_predicted_s"] is None and summary["epp"]["predicted_share"] is None


def routed(
    session: str, turn: int, endpoint: str, ttft_s: float, predicted_ms: float | None
) -> RequestResult:
    r = result(float(turn), None if predicted_ms is not None else "warming_up")
    r.session_id, r.turn, r.endpoint, r.ttft_s, r.predicted_ttft_ms = (
        session,
        turn,
        endpoint,
        ttft_s,
        predicted_ms,
    )
    return r


def test_prediction_error_session_moves_and_turn_split_come_from_the_debug_headers() -> None:
    results = [
        routed("a", 1, "e1", 0.1, 150.0),  # 50% off
        routed("a", 0, "e0", 0.4, None),  # first turn, no prediction
        routed("a", 2, "e1", 0.1, 110.0),  # 10% off; stayed
        routed("b", 0, "e2", 0.2, 200.0),  # exact
    ]
    summary = summarize("p", True, results, snapshot(0, 0), snapshot(4, 1), 10.0, 1.0)
    assert summary["session_moves"] == {"moved": 1, "stayed": 1}
    error = summary["epp"]["ttft_prediction_error"]
    assert error["requests"] == 3 and error["p50"] == 0.1 and error["mean"] == 0.2
    assert summary["ttft_ms_by_turn"]["first"]["p50"] == 300.0
    assert summary["ttft_ms_by_turn"]["later"]["p99"] == 100.0


def test_the_load_average_sampled_during_the_replay_is_reported() -> None:
    summary = summarize(
        "g", False, [result(1.0, None)], snapshot(0, 0), snapshot(1, 0), 2.0, 1.0, [1.5, 4.25, 3.0]
    )
    assert summary["load_average"] == {"samples": 3, "mean": 2.92, "max": 4.25}
    unsampled = summarize("g", False, [result(1.0, None)], snapshot(0, 0), snapshot(1, 0), 2.0, 1.0)
    assert unsampled["load_average"] == {"samples": 0, "mean": None, "max": None}


def test_the_load_sampler_appends_until_cancelled() -> None:
    async def sample_twice() -> list[float]:
        samples: list[float] = []
        task = asyncio.create_task(sample_load(samples, interval_s=0.001))
        while len(samples) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return samples

    samples = asyncio.run(sample_twice())
    assert len(samples) >= 2 and all(s >= 0.0 for s in samples)


def run_summary(round_: int, config: str, p50: float, p99: float) -> dict[str, Any]:
    return {
        "round": round_,
        "config": config,
        "ttft_ms": {"p50": p50, "p90": None, "p99": p99},
        "step_lag": {"all": {"p99_ms": 9.5}},
        "load_average": {"samples": 3, "mean": 3.5, "max": 4.75},
    }


def test_each_round_compares_its_configs_with_that_round_s_first() -> None:
    table = rounds_table(
        [
            run_summary(1, "gie-default", 100.0, 800.0),
            run_summary(1, "pl", 90.0, 600.0),
            run_summary(2, "gie-default", 200.0, 1000.0),
            run_summary(2, "pl", 210.0, 950.0),
        ]
    )
    rows = table.splitlines()[2:]
    assert rows[0] == "| 1 | gie-default | 100.0 / 800.0 | – | 9.5 | 3.5 / 4.8 |"
    assert rows[1] == "| 1 | pl | 90.0 / 600.0 | -10.0% / -25.0% | 9.5 | 3.5 / 4.8 |"
    assert rows[3] == "| 2 | pl | 210.0 / 950.0 | +5.0% / -5.0% | 9.5 | 3.5 / 4.8 |"
