"""The shipped saturation detectors: per endpoint, not averaged, and no overshoot between scrapes."""

from __future__ import annotations

from epp.flowcontrol.saturation import (
    PredictedTtftSaturationDetector,
    QueueKvSaturationDetector,
    TokenLoadSaturationDetector,
)
from epp.flowcontrol.types import PoolView
from epp.scheduling.framework import CycleState
from epp.scheduling.predictions import LATENCY_PREDICTIONS, EndpointPrediction, LatencyPredictions
from tests.epp.factories import endpoint_state
from tests.epp.flowcontrol.helpers import policy, request


def view(endpoints, now=0.0, **kwargs) -> PoolView:
    return PoolView(now, endpoints, kwargs.pop("booked", {}), kwargs.pop("routed", {}), **kwargs)


def test_queue_kv_sees_one_idle_endpoint_behind_a_hot_one():
    detector = policy(QueueKvSaturationDetector, queueDepthThreshold=5)
    hot, idle = endpoint_state(0, waiting=40), endpoint_state(1, waiting=0)
    assert not detector.saturated(view([hot, idle]), request())
    assert detector.saturated(view([hot, endpoint_state(1, waiting=5)]), request())


def test_queue_kv_counts_what_was_routed_and_dispatched_since_the_scrape():
    detector = policy(QueueKvSaturationDetector, queueDepthThreshold=5)
    e = endpoint_state(0, waiting=3)  # scraped at t=0
    assert not detector.saturated(view([e], now=0.01), request())
    routed = {"e0": {1: 0.005, 2: 0.008}}
    assert detector.saturated(view([e], now=0.01, routed=routed), request())
    before_scrape = {"e0": {1: -0.1, 2: -0.05}}  # already in the scraped queue
    assert not detector.saturated(view([e], now=0.01, routed=before_scrape), request())
    assert detector.saturated(view([e], now=0.01, pending_requests=2), request())


def test_queue_kv_full_kv_cache_or_stale_metrics_leave_no_room():
    detector = policy(QueueKvSaturationDetector, kvCacheUtilThreshold=0.8, metricsStalenessSeconds=0.2)
    assert detector.saturated(view([endpoint_state(0, kv=0.85)]), request())
    assert detector.saturated(view([endpoint_state(0)], now=0.5), request())
    assert not detector.saturated(view([endpoint_state(0, kv=0.5)], now=0.1), request())


def test_token_load_books_per_endpoint_and_always_lets_an_idle_pool_take_one():
    detector = policy(TokenLoadSaturationDetector, maxTokensPerEndpoint=1000)
    pool = [endpoint_state(0), endpoint_state(1)]
    assert not detector.saturated(view(pool), request(tokens=50_000))
    # e0 is over capacity; that does not eat into e1's headroom.
    assert not detector.saturated(view(pool, booked={"e0": 5000, "e1": 200}), request(tokens=800))
    assert detector.saturated(view(pool, booked={"e0": 5000, "e1": 200}), request(tokens=801))
    assert detector.saturated(view(pool, booked={"e1": 200}, pending_tokens=1000), request(tokens=900))
    # Two EPP replicas: the peer's bookings count, but each replica keeps its share (half) of the room.
    peers = {"e0": 500, "e1": 500}
    assert detector.saturated(
        view(pool, booked={"e0": 500, "e1": 400}, peer_tokens=peers, replicas=2), request(tokens=200)
    )
    assert not detector.saturated(
        view(pool, booked={"e1": 400}, peer_tokens=peers, replicas=2), request(tokens=200)
    )
    crowded = {"e0": 1000, "e1": 900}
    assert not detector.saturated(view(pool, peer_tokens=crowded, replicas=2), request(tokens=200))
    assert detector.saturated(
        view(pool, booked={"e0": 450, "e1": 450}, peer_tokens=crowded, replicas=2), request(tokens=200)
    )


def test_token_load_prefill_limit_fits_a_prompt_only_where_its_prefill_has_room():
    detector = policy(
        TokenLoadSaturationDetector, maxTokensPerEndpoint=100_000, maxPrefillTokensPerEndpoint=8192
    )
    pool = [endpoint_state(0), endpoint_state(1)]
    long_prompt, short_prompt = request(tokens=6400), request(tokens=600)
    long_prompt.prompt_tokens, short_prompt.prompt_tokens = 6000, 300
    busy = {"e0": 4000, "e1": 4000}
    assert not detector.saturated(view(pool, booked=busy, prefill_tokens=busy), long_prompt)
    assert detector.endpoints(view(pool, booked=busy, prefill_tokens=busy), long_prompt) == frozenset()
    assert detector.endpoints(view(pool, booked=busy, prefill_tokens=busy), short_prompt) == {"e0", "e1"}
    # An endpoint whose prompts all got their first token takes any prompt, and only it does.
    assert detector.endpoints(view(pool, booked=busy, prefill_tokens={"e0": 4000}), long_prompt) == {"e1"}
    # Peer replicas' prompts on their way through prefill count too.
    peers = {"e0": 100, "e1": 4000}
    fuller = view(pool, booked=busy, prefill_tokens={"e0": 4000}, peer_prefill_tokens=peers)
    assert detector.endpoints(fuller, long_prompt) == frozenset()
    # What an endpoint likely has cached of the prompt is not prefilled there.
    cached = view(pool, booked=busy, prefill_tokens=busy, cached_tokens=lambda r: {"e1": 5000})
    assert detector.endpoints(cached, long_prompt) == {"e1"}
    # A dispatched request not yet picked may be headed anywhere: no prefill room is known.
    assert detector.saturated(view(pool, booked=busy, pending_requests=1), short_prompt)
    unlimited = policy(TokenLoadSaturationDetector, maxTokensPerEndpoint=100_000)
    assert not unlimited.saturated(view(pool, booked=busy, prefill_tokens=busy), long_prompt)
    assert unlimited.endpoints(view(pool, booked=busy, prefill_tokens=busy), long_prompt) is None


def test_prefill_isolation_keeps_an_endpoint_clear_for_requests_with_a_ttft_objective():
    detector = policy(
        TokenLoadSaturationDetector,
        maxTokensPerEndpoint=100_000,
        maxPrefillTokensPerEndpoint=8192,
        isolatedPrefillTokens=2048,
    )
    pool = [endpoint_state(0), endpoint_state(1)]
    long_prompt, chat = request(tokens=4400), request(tokens=400, slo_ms=500)
    long_prompt.prompt_tokens, chat.prompt_tokens = 4000, 300
    # Idle pool: the long prompt may go anywhere, as another endpoint stays clear.
    assert detector.endpoints(view(pool), long_prompt) == {"e0", "e1"}
    # e0 prefills a long prompt: the next one may join it there, but not take e1, the clear one.
    one_long = view(pool, prefill_tokens={"e0": 4000})
    assert detector.endpoints(one_long, long_prompt) == {"e0"}
    assert detector.endpoints(one_long, chat) == {"e1"}  # the chat goes where no long prefill is
    # Both endpoints past the isolated budget (a peer's prompt): long prompts wait, a chat too,
    # until one endpoint is clear again.
    both = view(pool, prefill_tokens={"e0": 4000}, peer_prefill_tokens={"e1": 3000})
    assert detector.endpoints(both, long_prompt) == frozenset()
    assert detector.endpoints(both, chat) == frozenset()
    # A short prompt without an objective fits the clear endpoint while it stays clear.
    short = request(tokens=1100)
    short.prompt_tokens = 1000
    assert detector.endpoints(one_long, short) == {"e0", "e1"}
    # One endpoint alone cannot be isolated: only the prefill limit holds.
    assert detector.endpoints(view(pool[:1], prefill_tokens={"e0": 4000}), long_prompt) == {"e0"}


def _predicted(state: CycleState, **ttft_ms: float) -> CycleState:
    by = {name: EndpointPrediction(ms, 10.0, 0.0, None) for name, ms in ttft_ms.items()}
    state.put(LATENCY_PREDICTIONS, LatencyPredictions(by, None, None))
    return state


def test_predicted_ttft_saturates_when_no_endpoint_is_predicted_to_meet_the_slo():
    detector = policy(PredictedTtftSaturationDetector, defaultSloTtftMs=1000, maxAgeSeconds=1.0)
    pool = [endpoint_state(0), endpoint_state(1)]
    assert not detector.saturated(view(pool), request(slo_ms=100))  # no evidence yet
    detector.routed("e0", _predicted(CycleState(), e0=900.0, e1=1500.0), now=10.0)
    assert not detector.saturated(view(pool, now=10.0), request(received_at=10.0))
    assert detector.saturated(view(pool, now=10.0), request(received_at=10.0, slo_ms=500))
    # Waiting eats into the budget: e0's 900 ms no longer fits after 200 ms in the queue.
    assert detector.saturated(view(pool, now=10.2), request(received_at=10.0))
    assert not detector.saturated(view(pool, now=11.5), request(received_at=11.5, slo_ms=500))  # stale
