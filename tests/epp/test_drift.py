"""The drift monitor's rolling error and rule, and the predicted-latency producer falling back on drift."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from epp.latency.drift import DriftMonitor, DriftRule
from epp.latency.metrics import DriftCollector
from epp.scheduling.framework import RequestOutcome
from epp.scheduling.predictions import DRIFTED_PREDICTIONS, LATENCY_PREDICTIONS, PREDICTION_FALLBACK
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import endpoint_state, routed_request
from tests.epp.latency_fakes import (
    ConstantTpotPredictor,
    VersionedPredictor,
    produce,
    producer,
    streaming_request,
)


def test_rolling_mape_and_bias_over_the_last_window() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=4))
    for predicted, actual in [(100, 100), (150, 100), (50, 100), (100, 100), (120, 100)]:
        monitor.observe("ttft", 1, predicted, actual, now=0.0)
    (stats,) = monitor.stats()
    # The first pair has left the window: errors +0.5, -0.5, 0, +0.2.
    assert stats.samples == 4
    assert abs(stats.mape - 0.3) < 1e-9 and abs(stats.bias - 0.05) < 1e-9
    assert not monitor.drifting


def test_drift_needs_a_full_window_over_the_threshold_and_recovers_under_the_lower_one() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=5))
    for t in range(4):
        monitor.observe("ttft", 1, 100, 300, now=t)  # 67% too fast, but the window is not full
    assert not monitor.drifting
    monitor.observe("ttft", 1, 100, 300, now=4.0)
    assert monitor.drifting and monitor.take_retrain_request() and not monitor.take_retrain_request()
    # A new version whose error is between the thresholds does not end the drift ...
    for t in range(5):
        monitor.observe("ttft", 2, 140, 100, now=10 + t)
    assert monitor.drifting
    # ... a newer one does, once the window's MAPE is at most the recovery threshold:
    # after two of its requests, (3 x 40% + 2 x 10%) / 5 = 28%.
    for t in range(2):
        monitor.observe("ttft", 3, 110, 100, now=20 + t)
    assert not monitor.drifting
    assert [(e.at, e.drifting, e.version) for e in monitor.events] == [(4.0, True, 1), (21.0, False, 3)]
    # Only the newest versions' windows are kept.
    assert {s.version for s in monitor.stats()} == {1, 2, 3}
    monitor.observe("ttft", 4, 100, 100, now=30.0)
    assert {s.version for s in monitor.stats()} == {2, 3, 4}


def test_the_live_error_spans_versions_published_faster_than_a_window_fills() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=5))
    for t, version in enumerate([1, 1, 2, 2, 3]):
        monitor.observe("ttft", version, 100, 300, now=t)
    assert monitor.drifting
    assert [(s.version, s.samples) for s in monitor.stats()] == [(1, 2), (2, 2), (3, 1)]


def test_threshold_zero_never_drifts_and_unpredicted_targets_are_skipped() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.0, recover_threshold=0.3, window=5))
    for t in range(10):
        monitor.observe("ttft", 1, 100, 1000, now=t)
        monitor.observe("tpot", 1, 0.0, 20, now=t)  # a model without TPOT predicts 0
    assert not monitor.drifting
    assert [s.target for s in monitor.stats()] == ["ttft"]


def test_a_target_predicted_by_a_constant_is_measured_but_never_judged() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=5))
    for t in range(10):
        monitor.observe("ttft", 4, 100, 105, now=t)
        monitor.observe("tpot", 4, 20, 80, now=t, constant=True)  # the median of a light load, 75% off
    assert not monitor.drifting and monitor.events == []
    assert sorted((s.target, round(s.mape, 3)) for s in monitor.stats()) == [("tpot", 0.75), ("ttft", 0.048)]


def test_a_constant_replacing_drifting_trees_leaves_recovery_to_the_other_target() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=5))
    for t in range(5):
        monitor.observe("ttft", 1, 100, 100, now=t)
        monitor.observe("tpot", 1, 10, 40, now=t)  # fitted TPOT trees, 75% off
    assert monitor.drifting
    monitor.observe("ttft", 2, 100, 100, now=10.0)
    assert monitor.drifting  # TPOT's live window still holds the trees' error
    monitor.observe("tpot", 2, 20, 40, now=11.0, constant=True)
    monitor.observe("ttft", 2, 100, 100, now=12.0)
    assert not monitor.drifting and monitor.events[-1].at == 12.0
    # Trees serve TPOT again: judged afresh, once their own window is full.
    for t in range(4):
        monitor.observe("tpot", 3, 10, 40, now=20 + t)
    assert not monitor.drifting
    monitor.observe("tpot", 3, 10, 40, now=24.0)
    assert monitor.drifting


def test_collector_exports_error_per_target_and_version() -> None:
    monitor = DriftMonitor(DriftRule(threshold=0.5, recover_threshold=0.3, window=5))
    for t in range(5):
        monitor.observe("tpot", 7, 30, 10, now=t)
    registry = CollectorRegistry()
    registry.register(DriftCollector(monitor))
    labels = {"target": "tpot", "model_version": "7"}
    assert registry.get_sample_value("llm_epp_prediction_mape", labels) == 2.0
    assert registry.get_sample_value("llm_epp_prediction_bias", labels) == 2.0
    assert registry.get_sample_value("llm_epp_prediction_drifting") == 1.0
    assert registry.get_sample_value("llm_epp_prediction_drift_episodes_total") == 1.0


def _finish(plugin, request, state, ttft_s: float, tpot_s: float) -> None:
    endpoint = endpoint_state(0).endpoint
    outcome = RequestOutcome(endpoint, 0.0, ttft_s + 10 * tpot_s, 200, True, True, ttft_s, 11)
    plugin.on_finished(routed_request(request, SchedulingResult((endpoint,), "default"), state), outcome)


def test_producer_falls_back_with_reason_drift_keeps_measuring_and_asks_once_for_a_retrain() -> None:
    predictor = VersionedPredictor()
    plugin = producer(predictor, streamingMode=True, driftWindow=5)  # type: ignore[arg-type]
    endpoints = [endpoint_state(0)]
    for _ in range(5):  # actual TTFT 400 ms against 100 predicted: 75% off
        request = streaming_request()
        state = produce(plugin, request, endpoints)
        assert state.get(LATENCY_PREDICTIONS) is not None
        _finish(plugin, request, state, 0.4, 0.01)
    assert plugin.drift.drifting and predictor.retrains == 1
    # The engines are fast again: the same model is right; after 3 such requests the window's
    # MAPE is 2 x 75% / 5 = 30%, the recovery threshold.
    for _ in range(3):
        request = streaming_request()
        state = produce(plugin, request, endpoints)
        assert state.get(LATENCY_PREDICTIONS) is None and state.get(PREDICTION_FALLBACK) == "drift"
        assert state.get(DRIFTED_PREDICTIONS).by_endpoint["e0"].ttft_ms == 100.0
        _finish(plugin, request, state, 0.1, 0.01)
    assert not plugin.drift.drifting and predictor.retrains == 1
    state = produce(plugin, streaming_request(), endpoints)
    assert state.get(LATENCY_PREDICTIONS).model_version == 3 and state.get(PREDICTION_FALLBACK) is None
    assert len(predictor.samples) == 16  # it trained on every request, drifting or not


@pytest.mark.parametrize("correction", [False, True])
def test_producer_routes_on_predictions_whose_constant_tpot_is_far_off(correction: bool) -> None:
    predictor = ConstantTpotPredictor()
    plugin = producer(predictor, streamingMode=True, driftWindow=5, endpointCorrection=correction)  # type: ignore[arg-type]
    endpoints = [endpoint_state(0)]
    for _ in range(20):  # TTFT as predicted, TPOT 40 ms against the constant's 10: 75% off
        request = streaming_request()
        state = produce(plugin, request, endpoints)
        made = state.get(LATENCY_PREDICTIONS)
        assert made is not None and made.constant_targets == ("tpot",)
        _finish(plugin, request, state, 0.1, 0.04)
    assert not plugin.drift.drifting and predictor.retrains == 0
    assert {s.target for s in plugin.drift.stats()} == {"ttft", "tpot"}  # the constant's error is measured
