"""The flow controller's rules: band order, fairness, ordering, limits, cancellation."""

from __future__ import annotations

from epp.flowcontrol.controller import BandLimits, FlowController, FlowSettings
from epp.flowcontrol.fairness import LeastAttainedServiceFairness, RoundRobinFairness
from epp.flowcontrol.ordering import EarliestDeadlineOrdering, FcfsOrdering
from epp.flowcontrol.saturation import TokenLoadSaturationDetector
from epp.flowcontrol.types import Outcome
from epp.scheduling.cycle_data import PREFIX_MATCH, PrefixMatch
from epp.scheduling.framework import CycleState
from tests.epp.factories import endpoint_state
from tests.epp.flowcontrol.helpers import controller, policy, request

POOL = [endpoint_state(0)]


def dispatched(decisions):
    return [d.request for d in decisions if d.outcome is Outcome.DISPATCHED]


def test_an_unsaturated_pool_dispatches_at_once():
    fc, _ = controller(capacity=10)
    r = request()
    assert fc.enqueue(r, 1.0) == []
    [d] = fc.poll(1.0, POOL)
    assert (d.request, d.outcome, d.queue_time_s) == (r, Outcome.DISPATCHED, 0.0)
    assert len(fc) == 0 and fc.booked() == 1 and not fc.saturated


def test_saturated_pool_holds_requests_and_releases_them_highest_band_first():
    fc, detector = controller(capacity=0)
    low, mid, high = request(band=-1), request(band=0), request(band=5)
    for r in (low, mid, high):
        fc.enqueue(r, 0.0)
    assert fc.poll(0.0, POOL) == [] and fc.saturated and len(fc) == 3
    detector.capacity = 3
    assert dispatched(fc.poll(2.0, POOL)) == [high, mid, low]


def test_dispatch_stops_when_the_booked_requests_fill_the_pool_and_resumes_as_they_finish():
    fc, _ = controller(capacity=2)
    rs = [request() for _ in range(4)]
    for r in rs:
        fc.enqueue(r, 0.0)
    assert dispatched(fc.poll(0.0, POOL)) == rs[:2]
    fc.routed(rs[0].key, "e0", CycleState(), 0.1)
    assert fc.poll(0.2, POOL) == []
    fc.finished(rs[0].key)
    fc.finished(rs[0].key)  # idempotent
    assert dispatched(fc.poll(0.3, POOL)) == [rs[2]]
    fc.finished(rs[1].key)  # never routed (the scheduler refused it): its booking goes too
    assert dispatched(fc.poll(0.4, POOL)) == [rs[3]]


def test_round_robin_alternates_flows_whatever_their_sizes():
    fc, detector = controller(capacity=0)
    for _ in range(4):
        fc.enqueue(request(flow="a", tokens=5000), 0.0)
    for _ in range(2):
        fc.enqueue(request(flow="b", tokens=10), 0.0)
    detector.capacity = 10
    assert [r.flow for r in dispatched(fc.poll(1.0, POOL))] == ["a", "b", "a", "b", "a", "a"]


def test_least_attained_service_counts_tokens():
    fc, detector = controller(capacity=0, fairness=LeastAttainedServiceFairness)
    for _ in range(3):
        fc.enqueue(request(flow="long", tokens=1000), 0.0)
    for _ in range(12):
        fc.enqueue(request(flow="short", tokens=100), 0.0)
    detector.capacity = 12
    order = [r.flow for r in dispatched(fc.poll(1.0, POOL))]
    # One long request is worth ten short ones.
    assert order[:12] == ["long"] + ["short"] * 10 + ["long"]


def test_least_attained_service_gives_no_credit_for_idling():
    fc, detector = controller(capacity=100, fairness=LeastAttainedServiceFairness)
    for _ in range(5):
        fc.enqueue(request(flow="a", tokens=100), 0.0)
    dispatched(fc.poll(0.0, POOL))  # a was served 500 tokens while b was idle
    detector.capacity = 0
    for flow in ("a", "b", "a", "b", "a", "b"):
        fc.enqueue(request(flow=flow, tokens=100), 1.0)
    fc.enqueue(request(flow="c", tokens=100), 1.0)
    detector.capacity = 200
    order = [r.flow for r in dispatched(fc.poll(2.0, POOL))]
    # b and c start level with a (500 tokens), so the three share the pool from now on.
    assert sorted(order[:3]) == ["a", "b", "c"]


def test_earliest_deadline_ordering_inside_a_flow():
    fc, detector = controller(capacity=0, ordering=EarliestDeadlineOrdering)
    lax = request(received_at=0.0, slo_ms=5000)
    none = request(received_at=0.0)
    tight = request(received_at=0.5, slo_ms=200)
    for r in (lax, none, tight):
        fc.enqueue(r, 0.5)
    detector.capacity = 3
    assert dispatched(fc.poll(1.0, POOL)) == [tight, lax, none]


def test_requests_expire_after_their_bands_ttl():
    fc, _ = controller(capacity=0, bands={-1: BandLimits(ttl_s=1.0)}, default=BandLimits(ttl_s=5.0))
    batch, chat = request(band=-1), request(band=0)
    fc.enqueue(batch, 0.0)
    fc.enqueue(chat, 0.5)
    assert fc.next_expiry() == 1.0
    assert fc.poll(0.99, POOL) == []
    [d] = fc.poll(1.0, POOL)
    assert (d.request, d.outcome, d.queue_time_s) == (batch, Outcome.EXPIRED, 1.0)
    [d] = fc.poll(5.5, POOL)
    assert (d.request, d.outcome) == (chat, Outcome.EXPIRED)
    assert len(fc) == 0 and fc.next_expiry() is None


def test_a_full_band_rejects_newcomers():
    fc, _ = controller(capacity=0, bands={0: BandLimits(max_requests=2)})
    a, b, c = request(), request(), request()
    assert fc.enqueue(a, 0.0) == [] and fc.enqueue(b, 0.0) == []
    [d] = fc.enqueue(c, 0.0)
    assert (d.request, d.outcome) == (c, Outcome.REJECTED)
    assert fc.enqueue(request(band=1), 0.0) == []  # other bands have their own limit


def test_a_full_queue_sheds_the_newest_sheddable_request_first():
    fc, _ = controller(capacity=0, max_queued=3)
    old_batch, new_batch, chat = request(band=-1), request(band=-1), request(band=0)
    for r in (old_batch, new_batch, chat):
        fc.enqueue(r, 0.0)
    urgent = request(band=0)
    [d] = fc.enqueue(urgent, 1.0)
    assert (d.request, d.outcome) == (new_batch, Outcome.EVICTED)
    assert urgent.key in fc and old_batch.key in fc
    another_batch = request(band=-1)
    [d] = fc.enqueue(another_batch, 1.0)  # no band below its own to take room from
    assert (d.request, d.outcome) == (another_batch, Outcome.REJECTED)
    [d] = fc.enqueue(request(band=0), 1.0)
    assert d.outcome is Outcome.EVICTED and d.request is old_batch
    [d] = fc.enqueue(last := request(band=0), 1.0)  # only non-sheddable requests are left
    assert (d.request, d.outcome) == (last, Outcome.REJECTED)


def test_cancellation_removes_a_queued_request_at_once():
    fc, detector = controller(capacity=0)
    a, b = request(flow="a"), request(flow="b")
    fc.enqueue(a, 0.0)
    fc.enqueue(b, 0.0)
    d = fc.cancel(a.key, 0.25)
    assert d is not None and d.outcome is Outcome.CANCELLED and d.queue_time_s == 0.25
    assert a.key not in fc and fc.queue_sizes() == {(0, "b"): 1}
    assert fc.cancel(a.key, 0.3) is None
    detector.capacity = 5
    assert dispatched(fc.poll(1.0, POOL)) == [b]


def test_a_large_head_of_one_flow_does_not_hold_back_a_smaller_request_of_another():
    detector = policy(TokenLoadSaturationDetector, maxTokensPerEndpoint=1000)
    fc = FlowController(FlowSettings(), policy(RoundRobinFairness), policy(FcfsOrdering), [detector])
    running = request(flow="c", tokens=700)
    fc.enqueue(running, 0.0)
    assert dispatched(fc.poll(0.0, POOL)) == [running]
    big, small = request(flow="a", tokens=600), request(flow="b", tokens=200)
    fc.enqueue(big, 0.1)
    fc.enqueue(small, 0.2)
    assert dispatched(fc.poll(0.3, POOL)) == [small]  # 300 tokens of room: a's 600 waits, b's 200 fits
    assert big.key in fc
    assert fc.poll(0.4, POOL) == [] and fc.saturated
    fc.finished(running.key)
    assert dispatched(fc.poll(0.5, POOL)) == [big]


def test_a_prompt_is_booked_as_prefill_from_routing_to_its_first_token():
    detector = policy(
        TokenLoadSaturationDetector, maxTokensPerEndpoint=100_000, maxPrefillTokensPerEndpoint=5000
    )
    fc = FlowController(FlowSettings(), policy(RoundRobinFairness), policy(FcfsOrdering), [detector])
    first, second, third = (request(flow="a", tokens=4400) for _ in range(3))
    for r in (first, second, third):
        r.prompt_tokens = 4000
        fc.enqueue(r, 0.0)
    assert dispatched(fc.poll(0.0, POOL)) == [first]  # on its way to the pick: nothing else goes
    fc.routed(first.key, "e0", CycleState(), 0.01)
    assert fc.poll(0.02, POOL) == [] and fc.saturated  # 4000 + 4000 prompt tokens > 5000
    fc.first_token(first.key)
    fc.first_token(first.key)  # idempotent
    assert dispatched(fc.poll(0.03, POOL)) == [second]
    fc.routed(second.key, "e0", CycleState(), 0.04)
    fc.finished(second.key)  # over before its first token (cancelled): its prefill goes too
    assert dispatched(fc.poll(0.05, POOL)) == [third]


def test_a_dispatch_names_the_endpoints_it_fits_and_a_routed_prompt_books_its_uncached_tokens():
    detector = policy(
        TokenLoadSaturationDetector, maxTokensPerEndpoint=100_000, maxPrefillTokensPerEndpoint=5000
    )
    fc = FlowController(FlowSettings(), policy(RoundRobinFairness), policy(FcfsOrdering), [detector])
    pool = [endpoint_state(0), endpoint_state(1)]
    first, second = request(tokens=4400), request(tokens=4400)
    first.prompt_tokens = second.prompt_tokens = 4000
    fc.enqueue(first, 0.0)
    [d] = fc.poll(0.0, pool)
    assert d.outcome is Outcome.DISPATCHED and d.endpoints == {"e0", "e1"}
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(62, {"e0": 50}, block_size_tokens=64))  # 3200 tokens cached on e0
    fc.routed(first.key, "e0", state, 0.01)
    fc.enqueue(second, 0.02)
    [d] = fc.poll(0.02, pool)  # e0 has 800 prompt tokens to prefill: 800 + 4000 fit its 5000
    assert d.endpoints == {"e0", "e1"}
    fc.routed(second.key, "e1", CycleState(), 0.03)  # no prefix match: all 4000 to prefill
    third = request(tokens=4400)
    third.prompt_tokens = 4000
    fc.enqueue(third, 0.04)
    [d] = fc.poll(0.04, pool)  # e0: 800 + 4000 fit; e1: 4000 + 4000 do not
    assert d.request is third and d.endpoints == {"e0"}
