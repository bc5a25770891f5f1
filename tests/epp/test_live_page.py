"""The live page's data: recent decisions (an observer), their JSON and the metrics port's routes."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from epp.datalayer.endpoints import EndpointStore
from epp.load.token_load import TokenLoadTracker
from epp.observability.live import LiveData
from epp.observability.recent import RecentDecisions
from epp.observability.server import metrics_app
from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.predictions import (
    LATENCY_PREDICTIONS,
    PREDICTION_FALLBACK,
    EndpointPrediction,
    LatencyPredictions,
)
from epp.scheduling.types import EngineMetrics, SchedulingResult
from tests.epp.factories import FakeClock, endpoint_state, make_request


def _outcome(
    endpoint_index: int, *, ttft_s: float = 0.2, tokens: int = 11, completed: bool = True
) -> RequestOutcome:
    return RequestOutcome(
        endpoint=endpoint_state(endpoint_index).endpoint, received_at=100.0, finished_at=100.0 + ttft_s + 1.0,
        status=200 if completed else 503, streaming=True, completed=completed,
        first_token_at=100.0 + ttft_s, completion_tokens=tokens,
    )  # fmt: skip


def _finish(recent: RecentDecisions, *, slo_ttft_ms: float | None = None, fallback: str | None = None,
            predicted_ttft_ms: float | None = None, **outcome: Any) -> None:  # fmt: skip
    request = dataclasses.replace(make_request([1, 2, 3], request_id=f"r{recent.snapshot()[1].finished}"),
                                  slo_ttft_ms=slo_ttft_ms, stream=True)  # fmt: skip
    state = CycleState()
    if fallback is not None:
        state.put(PREDICTION_FALLBACK, fallback)
    if predicted_ttft_ms is not None:
        by = {"e0": EndpointPrediction(predicted_ttft_ms, 10.0, -predicted_ttft_ms, None),
              "e1": EndpointPrediction(900.0, 12.0, -900.0, None)}  # fmt: skip
        state.put(LATENCY_PREDICTIONS, LatencyPredictions(by, slo_ttft_ms, None))
    ends = _outcome(0, **outcome)
    result = SchedulingResult(
        targets=(ends.endpoint,), profile="predicted-latency", scores={"e0": 0.9, "e1": 0.1}
    )
    recent.on_finished(RoutedRequest(request, result, state, endpoint_state(0), 100.0), ends)


def test_decisions_keep_prediction_outcome_slo_and_trace() -> None:
    recent = RecentDecisions()
    _finish(recent, slo_ttft_ms=500, predicted_ttft_ms=180.0, ttft_s=0.2)
    _finish(recent, slo_ttft_ms=100, predicted_ttft_ms=50.0, ttft_s=0.2)
    _finish(recent, fallback="unavailable", ttft_s=0.2)
    _finish(recent, slo_ttft_ms=500, completed=False)
    decisions, totals = recent.snapshot()
    assert [d.slo_met for d in decisions] == [True, False, None, False]
    first = decisions[0]
    assert (first.endpoint, first.predicted_ttft_ms) == ("e0", 180.0)
    assert (first.ttft_ms, first.tpot_ms) == (pytest.approx(200.0), pytest.approx(100.0))
    # The decision trace (epp.observability.decision); this result did not come from a pipeline,
    # so it has the picker's totals and the predictions but no filter or scorer steps.
    assert first.trace == {
        "profile": "predicted-latency",
        "candidates": 2,
        "total": {"e0": 0.9, "e1": 0.1},
        "picked": "e0",
        "fallbacks": [],
        "model_version": None,
        "predictions": {
            "e0": {"ttft_ms": 180.0, "tpot_ms": 10.0, "ttft_headroom_ms": -180.0, "tpot_headroom_ms": None},
            "e1": {"ttft_ms": 900.0, "tpot_ms": 12.0, "ttft_headroom_ms": -900.0, "tpot_headroom_ms": None},
        },
        "fallback": None,
    }
    assert decisions[2].fallback == "unavailable" and decisions[2].predicted_ttft_ms is None
    assert totals.finished == 4 and totals.slo_checked == 3 and totals.slo_met == 1
    assert totals.fallbacks == {"unavailable": 1}


def test_the_ring_keeps_the_newest_and_the_totals_keep_counting() -> None:
    recent = RecentDecisions(capacity=3)
    for _ in range(5):
        _finish(recent)
    decisions, totals = recent.snapshot()
    assert [d.request_id for d in decisions] == ["r2", "r3", "r4"]
    assert totals.finished == 5


def _live(clock: FakeClock) -> tuple[LiveData, RecentDecisions, TokenLoadTracker]:
    store = EndpointStore()
    store.replace([endpoint_state(0).endpoint, endpoint_state(1).endpoint])
    store.record_scrape("e0", EngineMetrics(waiting=3, running=2, kv_cache_usage=0.5, updated_at=clock()))
    recent = RecentDecisions()
    tracker = TokenLoadTracker()
    tracker.admit("b1", "e0", prompt_tokens=100, cached_tokens=60, expected_output=10)
    return LiveData("pool", "predicted-latency", store, recent, clock, [tracker]), recent, tracker


def test_snapshot_shows_endpoints_load_window_and_ages() -> None:
    clock = FakeClock(200.0)
    live, recent, _ = _live(clock)
    _finish(recent, slo_ttft_ms=500, predicted_ttft_ms=150.0, ttft_s=0.2)
    _finish(recent, slo_ttft_ms=100, fallback="timeout", ttft_s=0.2)
    data = live.snapshot()
    e0, e1 = data["endpoints"]
    assert (e0["name"], e0["queue"], e0["running"], e0["kv_usage"], e0["healthy"]) == ("e0", 3, 2, 0.5, True)
    assert e0["token_load"] == 40 and e1["token_load"] == 0 and not e1["healthy"]
    window = data["window"]
    assert (window["requests"], window["slo_attainment"], window["fallbacks"]) == (2, 0.5, {"timeout": 1})
    assert window["ttft_error"] == pytest.approx(0.25)  # |150 - 200| / 200
    assert [d["age_s"] for d in data["decisions"]] == [98.8, 98.8]
    json.dumps(data)  # JSON-ready as is


def _get(app: Any, path: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.input": io.BytesIO()}
    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


def test_metrics_port_serves_the_page_its_data_and_still_the_metrics() -> None:
    live, recent, _ = _live(FakeClock())
    _finish(recent)
    registry = CollectorRegistry()
    Counter("llm_epp_test_requests", "a counter", registry=registry).inc()
    app = metrics_app(registry, live)
    status, headers, body = _get(app, "/dashboard")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/html")
    assert b'fetch("/dashboard/data"' in body and b"<script src" not in body  # nothing fetched from elsewhere
    status, headers, body = _get(app, "/dashboard/data")
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body)["totals"]["finished"] == 1
    status, _, body = _get(app, "/metrics")
    assert status.startswith("200") and b"llm_epp_test_requests_total 1.0" in body
