"""Per-endpoint corrections learned online, and the predicted-latency producer applying them."""

from __future__ import annotations

import math

import pytest

from epp.latency.correction import EndpointCorrections
from epp.latency.predictions import LATENCY_PREDICTIONS
from epp.scheduling.framework import RequestOutcome
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import endpoint_state
from tests.epp.latency_fakes import VersionedPredictor, produce, producer, streaming_request


def test_a_correction_moves_half_way_to_the_endpoints_bias_per_half_life() -> None:
    corrections = EndpointCorrections(half_life=10)
    assert corrections.factor("slow", "ttft") == 1.0
    for _ in range(10):
        corrections.observe("slow", "ttft", 100.0, 250.0)
    assert math.log(corrections.factor("slow", "ttft")) == pytest.approx(0.5 * math.log(2.5))
    for _ in range(90):
        corrections.observe("slow", "ttft", 100.0, 250.0)
    assert corrections.factor("slow", "ttft") == pytest.approx(2.5, rel=0.01)
    assert corrections.factor("slow", "tpot") == 1.0 and corrections.factor("fast", "ttft") == 1.0


def test_unpredicted_or_unmeasured_samples_teach_nothing_and_outliers_are_clipped() -> None:
    corrections = EndpointCorrections(half_life=1)
    corrections.observe("e", "tpot", 0.0, 20.0)  # no TPOT model
    corrections.observe("e", "ttft", 100.0, 0.0)  # a TPOT-only sample
    assert corrections.factor("e", "tpot") == corrections.factor("e", "ttft") == 1.0
    for _ in range(60):
        corrections.observe("e", "ttft", 1.0, 1e9)
    assert corrections.factor("e", "ttft") == pytest.approx(20.0)
    with pytest.raises(ValueError):
        EndpointCorrections(half_life=0)


def _finish(plugin, request, state, endpoint_index: int, ttft_s: float, tpot_s: float) -> None:
    endpoint = endpoint_state(endpoint_index).endpoint
    outcome = RequestOutcome(endpoint, 0.0, ttft_s + 10 * tpot_s, 200, True, True, ttft_s, 11)
    plugin.on_finished(request, SchedulingResult((endpoint,), "default"), state, outcome)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_producer_learns_which_endpoint_is_slow_from_its_own_requests(enabled: bool) -> None:
    """The model says 100 ms / 10 ms everywhere; e1 takes 2.5 times that, e0 exactly that. With
    the correction e1's predictions follow it after its own requests; without, they stay."""
    predictor = VersionedPredictor()
    plugin = producer(predictor, streamingMode=True, endpointCorrection=enabled, correctionHalfLife=5)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    for index in range(60):
        request = streaming_request()
        state = produce(plugin, request, endpoints)
        slow = index % 2
        _finish(plugin, request, state, slow, 0.1 * (1 + 1.5 * slow), 0.01 * (1 + 1.5 * slow))
    predictions = produce(plugin, streaming_request(), endpoints).get(LATENCY_PREDICTIONS).by_endpoint
    if enabled:
        assert predictions["e1"].ttft_ms == pytest.approx(250.0, rel=0.05)
        assert predictions["e1"].tpot_ms == pytest.approx(25.0, rel=0.05)
        assert predictions["e0"].ttft_ms == pytest.approx(100.0)
    else:
        assert predictions["e1"].ttft_ms == predictions["e0"].ttft_ms == 100.0
    # the model still trains on the endpoints' actuals, never on corrected predictions
    assert len(predictor.samples) == 120
