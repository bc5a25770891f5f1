"""The decision trace: filters' removals, scorers' weighted scores, the pick, predictions; bounded."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from typing import Any

import pytest

from epp.observability.decision import (
    DECISION_HEADER,
    DECISION_TRACE,
    MAX_BYTES,
    MAX_ENDPOINTS,
    DecisionLog,
    decision_trace,
)
from epp.observability.recent import RecentDecisions
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.types import EndpointState
from tests.epp.factories import FakeClock, endpoint_state, make_request, run
from tests.epp.latency_fakes import DECISION_CONFIG, QueuePredictor


def _route(endpoints: list[EndpointState], **request: Any) -> tuple[RequestLifecycle, RoutedRequest]:
    context = PluginContext(clock=FakeClock(), rng=random.Random(1), latency_predictor=QueuePredictor())
    pipeline = build_pipeline(EndpointPickerConfig.from_yaml(DECISION_CONFIG), context)
    lifecycle = RequestLifecycle(pipeline, [DecisionLog()])
    req = dataclasses.replace(make_request(list(range(20))), stream=True, debug=True, **request)
    return lifecycle, run(lifecycle.route(req, endpoints, 0.0, 0.0))


def test_trace_names_what_each_step_did() -> None:
    endpoints = [endpoint_state(0, waiting=5), endpoint_state(1, waiting=1, kv=0.5), endpoint_state(2)]
    lifecycle, routed = _route(endpoints, slo_ttft_ms=300.0)
    trace = json.loads(lifecycle.debug_headers(routed)[DECISION_HEADER])
    assert trace["profile"] == "default" and trace["candidates"] == 3
    # e0's predicted 600 ms misses the 300 ms SLO; the tier filter removed it.
    assert trace["removed"] == {"slo-headroom-tier-filter": ["e0"]}
    assert set(trace["scores"]) == {"queue-scorer", "kv-cache-utilization-scorer"}
    queue, kv = trace["scores"]["queue-scorer"], trace["scores"]["kv-cache-utilization-scorer"]
    assert set(queue) == set(kv) == {"e1", "e2"}
    assert queue["e2"] == 2.0 and queue["e1"] < 2.0  # weight 2 × the emptiest queue's score 1
    assert kv["e1"] == pytest.approx(0.5) and kv["e2"] == 1.0
    assert trace["total"] == {name: round(queue[name] + kv[name], 4) for name in ("e1", "e2")}
    assert trace["picked"] == "e2" == routed.endpoint_name and trace["fallbacks"] == ["e1"]
    assert trace["model_version"] == 3 and trace["fallback"] is None
    e0 = trace["predictions"]["e0"]
    assert (e0["ttft_ms"], e0["ttft_headroom_ms"]) == (600.0, -300.0)
    assert trace == decision_trace(routed)  # the header is the trace the span and the log carry


def test_a_large_pool_is_bounded() -> None:
    endpoints = [endpoint_state(i, waiting=i % 7) for i in range(300)]
    lifecycle, routed = _route(endpoints)
    header = lifecycle.debug_headers(routed)[DECISION_HEADER]
    trace = json.loads(header)
    assert len(header) <= MAX_BYTES
    assert trace["candidates"] == 300 and trace["omitted"] == 300 - MAX_ENDPOINTS
    assert len(trace["total"]) == MAX_ENDPOINTS and trace["picked"] in trace["total"]
    assert all(len(scores) == MAX_ENDPOINTS for scores in trace["scores"].values())


def test_long_names_drop_detail_to_stay_under_the_bound() -> None:
    endpoints = [endpoint_state(i) for i in range(8)]
    for e in endpoints:
        e.endpoint = dataclasses.replace(e.endpoint, name=f"{e.endpoint.name}-{'x' * 200}")
    lifecycle, routed = _route(endpoints)
    header = lifecycle.debug_headers(routed)[DECISION_HEADER]
    trace = json.loads(header)
    assert len(header) <= MAX_BYTES and trace["truncated"] is True
    assert "scores" not in trace and trace["picked"] == routed.endpoint_name


def test_one_debug_log_line_per_finished_request_without_prompt_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lifecycle, routed = _route([endpoint_state(0), endpoint_state(1)], body={"prompt": "secret words"})
    with caplog.at_level(logging.DEBUG, logger="epp.decisions"):
        lifecycle.first_token(routed, 0.1)
        lifecycle.finished(routed, 0.5, status=200, completed=True, streaming=True, completion_tokens=5)
    (record,) = [r for r in caplog.records if r.name == "epp.decisions"]
    line = json.loads(record.getMessage().removeprefix("decision "))
    assert (line["request_id"], line["endpoint"], line["status"], line["ttft_ms"]) == (
        "r",
        routed.endpoint_name,
        200,
        100.0,
    )
    assert line["decision"] == decision_trace(routed)
    assert "secret" not in record.getMessage()


def test_the_live_page_shows_the_trace_built_when_it_is_read() -> None:
    """The recent decisions keep what the trace is built from, not the trace: built when the page
    reads it, it is the trace the debug header carries, and it is built once."""
    endpoints = [endpoint_state(0, waiting=5), endpoint_state(1, waiting=1, kv=0.5), endpoint_state(2)]
    lifecycle, routed = _route(endpoints, slo_ttft_ms=300.0)
    recent = RecentDecisions()
    lifecycle.add_observer(recent)
    lifecycle.finished(routed, 1.0, status=200, completed=True, streaming=True, completion_tokens=4)
    assert DECISION_TRACE not in routed.state  # nobody asked for it yet
    (decision,), _ = recent.snapshot()
    assert decision.trace == json.loads(lifecycle.debug_headers(routed)[DECISION_HEADER])
    assert decision.trace["removed"] == {"slo-headroom-tier-filter": ["e0"]}
    assert decision.trace["picked"] == "e2" and decision.trace["model_version"] == 3
    assert recent.snapshot()[0][0].trace is decision.trace


def test_the_live_page_reuses_a_trace_the_debug_header_built() -> None:
    endpoints = [endpoint_state(0, waiting=5), endpoint_state(1, waiting=1, kv=0.5), endpoint_state(2)]
    lifecycle, routed = _route(endpoints, slo_ttft_ms=300.0)
    recent = RecentDecisions()
    lifecycle.add_observer(recent)
    header = lifecycle.debug_headers(routed)[DECISION_HEADER]
    lifecycle.finished(routed, 1.0, status=200, completed=True, streaming=True, completion_tokens=4)
    (decision,), _ = recent.snapshot()
    assert decision.trace is routed.state.get(DECISION_TRACE) and decision.trace == json.loads(header)
