"""Per-endpoint corrections learned online, and the predicted-latency producer applying them."""

from __future__ import annotations

import math

import pytest

from epp.latency.correction import EndpointCorrections
from epp.scheduling.framework import RequestOutcome
from epp.scheduling.predictions import LATENCY_PREDICTIONS
from epp.scheduling.types import SchedulingResult
from tests.epp.factories import endpoint_state, routed_request
from tests.epp.latency_fakes import VersionedPredictor, produce, producer, streaming_request

SQRT = math.sqrt(2.5)


def test_a_correction_moves_half_way_to_the_endpoints_relative_bias_per_half_life() -> None:
    """A model fitted to a pool of one fast and one 2.5x slower endpoint predicts their geometric
    mean: sqrt(2.5) too slow for one, too fast for the other."""
    corrections = EndpointCorrections(half_life=10)
    assert corrections.factor("slow", "ttft") == 1.0
    for _ in range(10):
        corrections.observe("slow", "ttft", 100.0, 100.0 * SQRT)
        corrections.observe("fast", "ttft", 100.0, 100.0 / SQRT)
    assert math.log(corrections.factor("slow", "ttft")) == pytest.approx(0.5 * math.log(SQRT))
    for _ in range(90):
        corrections.observe("slow", "ttft", 100.0, 100.0 * SQRT)
        corrections.observe("fast", "ttft", 100.0, 100.0 / SQRT)
    assert corrections.factor("slow", "ttft") == pytest.approx(SQRT, rel=0.01)
    assert corrections.factor("fast", "ttft") == pytest.approx(1 / SQRT, rel=0.01)
    assert corrections.factor("slow", "tpot") == 1.0 and corrections.factor("new", "ttft") == 1.0


def test_an_error_every_endpoint_shares_is_left_to_the_model() -> None:
    corrections = EndpointCorrections(half_life=5)
    for _ in range(50):  # the engines all slowed down since the last retrain
        for endpoint in ("a", "b", "c"):
            corrections.observe(endpoint, "ttft", 100.0, 300.0)
    assert [corrections.factor(e, "ttft") for e in "abc"] == pytest.approx([1.0, 1.0, 1.0])


def test_unpredicted_or_unmeasured_samples_teach_nothing_and_outliers_are_clipped() -> None:
    corrections = EndpointCorrections(half_life=1)
    corrections.observe("e", "tpot", 0.0, 20.0)  # no TPOT model
    corrections.observe("e", "ttft", 100.0, 0.0)  # a TPOT-only sample
    corrections.observe("f", "tpot", 10.0, 10.0)
    assert corrections.factor("e", "tpot") == corrections.factor("e", "ttft") == 1.0
    for _ in range(60):
        corrections.observe("e", "ttft", 1.0, 1e9)
        corrections.observe("f", "ttft", 1.0, 1.0)
    assert corrections.factor("e", "ttft") == pytest.approx(math.sqrt(20.0))
    with pytest.raises(ValueError):
        EndpointCorrections(half_life=0)


def _finish(plugin, request, state, endpoint_index: int, ttft_s: float, tpot_s: float) -> None:
    endpoint = endpoint_state(endpoint_index).endpoint
    outcome = RequestOutcome(endpoint, 0.0, ttft_s + 10 * tpot_s, 200, True, True, ttft_s, 11)
    plugin.on_finished(routed_request(request, SchedulingResult((endpoint,), "default"), state), outcome)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_producer_learns_which_endpoint_is_slow_from_its_own_requests(enabled: bool) -> None:
    """The model says 100 ms / 10 ms everywhere, the geometric mean of its two endpoints: e1 takes
    sqrt(2.5) times that, e0 1/sqrt(2.5). With the correction each endpoint's predictions follow
    it after its own requests; without, they stay."""
    predictor = VersionedPredictor()
    plugin = producer(predictor, streamingMode=True, endpointCorrection=enabled, correctionHalfLife=5)
    endpoints = [endpoint_state(0), endpoint_state(1)]
    for index in range(60):
        request = streaming_request()
        state = produce(plugin, request, endpoints)
        slow = index % 2
        speed = SQRT if slow else 1 / SQRT
        _finish(plugin, request, state, slow, 0.1 * speed, 0.01 * speed)
    predictions = produce(plugin, streaming_request(), endpoints).get(LATENCY_PREDICTIONS).by_endpoint
    if enabled:
        assert predictions["e1"].ttft_ms == pytest.approx(100.0 * SQRT, rel=0.05)
        assert predictions["e1"].tpot_ms == pytest.approx(10.0 * SQRT, rel=0.05)
        assert predictions["e0"].ttft_ms == pytest.approx(100.0 / SQRT, rel=0.05)
    else:
        assert predictions["e1"].ttft_ms == predictions["e0"].ttft_ms == 100.0
    # the model still trains on the endpoints' actuals, never on corrected predictions
    assert len(predictor.samples) == 120
