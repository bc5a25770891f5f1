"""The live replay's per-config summary, from results and metrics made up here (no stack)."""

from __future__ import annotations

from bench.live_replay import RequestResult, Snapshot, summarize


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
