"""Property tests of the controller against a plain reference model of its rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from epp.flowcontrol.controller import BandLimits
from epp.flowcontrol.fairness import LeastAttainedServiceFairness, RoundRobinFairness
from epp.flowcontrol.types import FlowRequest, Outcome
from epp.scheduling.framework import CycleState
from tests.epp.factories import endpoint_state
from tests.epp.flowcontrol.helpers import controller, request

POOL = [endpoint_state(0)]
BANDS = (-1, 0, 2)
FLOWS = ("a", "b", "c")
LIMITS = {-1: BandLimits(max_requests=6, ttl_s=1.0), 0: BandLimits(max_requests=8, ttl_s=3.0)}
DEFAULT = BandLimits(max_requests=5, ttl_s=2.0)
MAX_QUEUED = 7

ARGUMENTS = {
    "enqueue": st.tuples(st.sampled_from(BANDS), st.sampled_from(FLOWS), st.integers(1, 3000)),
    "cancel": st.tuples(st.integers(0, 1000)),
    "finish": st.tuples(st.integers(0, 1000)),
    "route": st.tuples(st.integers(0, 1000)),
    "capacity": st.tuples(st.integers(0, 6)),
    "advance": st.tuples(st.floats(0.0, 0.8)),
}
# Half of the steps are arrivals, so queues fill up and overflow.
op = st.sampled_from(["enqueue"] * 5 + [k for k in ARGUMENTS if k != "enqueue"]).flatmap(
    lambda kind: ARGUMENTS[kind].map(lambda args: (kind, *args))
)


@dataclass
class Reference:
    """The rules, written as plainly as possible: lists and scans, no heaps."""

    queued: list[FlowRequest] = field(default_factory=list)
    booked: set[int] = field(default_factory=set)
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    def enqueue(self, r: FlowRequest) -> list[tuple[int, Outcome]]:
        limits = LIMITS.get(r.band, DEFAULT)
        if sum(q.band == r.band for q in self.queued) >= limits.max_requests:
            return [(r.key, Outcome.REJECTED)]
        shed = []
        if len(self.queued) >= MAX_QUEUED:
            lower = [q for q in self.queued if q.band < 0 and q.band < r.band]
            if not lower:
                return [(r.key, Outcome.REJECTED)]
            lowest = min(q.band for q in lower)
            victim = max((q for q in lower if q.band == lowest), key=lambda q: q.seq)
            self.queued.remove(victim)
            shed.append((victim.key, Outcome.EVICTED))
        self.queued.append(r)
        return shed

    def expired(self, now: float) -> set[int]:
        return {q.key for q in self.queued if q.enqueued_at + LIMITS.get(q.band, DEFAULT).ttl_s <= now}

    def check_dispatch(self, r: FlowRequest) -> None:
        assert r.band == max(q.band for q in self.queued), "a higher band was waiting"
        same_flow = [q for q in self.queued if q.band == r.band and q.flow == r.flow]
        assert r is min(same_flow, key=lambda q: (q.enqueued_at, q.seq)), "not first come first served"
        self.queued.remove(r)
        self.booked.add(r.key)


def _settle(ref: Reference, decisions) -> None:
    for d in decisions:
        assert d.request.key not in ref.outcomes, "a request left the queue twice"
        ref.outcomes[d.request.key] = d.outcome


@settings(max_examples=100, deadline=None)
@given(
    st.lists(op, min_size=10, max_size=100),
    st.sampled_from([RoundRobinFairness, LeastAttainedServiceFairness]),
)
def test_every_request_is_dispatched_shed_or_cancelled_exactly_once(ops, fairness):
    fc, detector = controller(
        capacity=0, fairness=fairness, bands=LIMITS, default=DEFAULT, max_queued=MAX_QUEUED
    )
    ref = Reference()
    now = 0.0
    issued: list[FlowRequest] = []
    routed: set[int] = set()

    def poll() -> None:
        expected_expired = ref.expired(now)
        decisions = fc.poll(now, POOL)
        expired = {d.request.key for d in decisions if d.outcome is Outcome.EXPIRED}
        assert expired == expected_expired
        ref.queued = [q for q in ref.queued if q.key not in expired]
        for d in decisions:
            if d.outcome is Outcome.DISPATCHED:
                ref.check_dispatch(d.request)
        # It dispatched as long as the pool had room, and stopped when it had none.
        assert (len(ref.booked) >= detector.capacity) or not ref.queued
        assert len(ref.booked) <= max(detector.capacity, 0) or not any(
            d.outcome is Outcome.DISPATCHED for d in decisions
        )
        _settle(ref, decisions)

    for action, *args in ops:
        if action == "enqueue":
            r = request(band=args[0], flow=args[1], tokens=args[2], received_at=now)
            issued.append(r)
            expected = ref.enqueue(r)
            decisions = fc.enqueue(r, now)
            assert [(d.request.key, d.outcome) for d in decisions] == expected
            _settle(ref, decisions)
            if any(d.outcome is Outcome.EVICTED for d in decisions):
                event("evicted")
            poll()
        elif action == "cancel" and issued:
            r = issued[args[0] % len(issued)]
            d = fc.cancel(r.key, now)
            was_queued = r in ref.queued
            assert (d is not None) == was_queued
            if d is not None:
                ref.queued.remove(r)
                _settle(ref, [d])
        elif action in ("finish", "route") and ref.booked:
            key = sorted(ref.booked)[args[0] % len(ref.booked)]
            if action == "route" and key not in routed:
                fc.routed(key, "e0", CycleState(), now)
                routed.add(key)
            elif action == "finish":
                fc.finished(key)
                ref.booked.discard(key)
                poll()
        elif action == "capacity":
            detector.capacity = args[0]
            poll()
        elif action == "advance":
            now += args[0]
            poll()
        assert len(fc) == len(ref.queued)
        assert sum(fc.queue_sizes().values()) == len(ref.queued)
    # Drain: with room for everyone, whatever is still queued is dispatched.
    detector.capacity = 10_000
    poll()
    assert len(fc) == 0
    assert set(ref.outcomes) == {r.key for r in issued}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 2000), min_size=30, max_size=30), min_size=2, max_size=4),
    st.sampled_from([RoundRobinFairness, LeastAttainedServiceFairness]),
)
def test_backlogged_flows_share_the_pool_fairly(sizes_per_flow, fairness):
    """While every flow has requests waiting, round-robin serves them within one request of
    each other, and least-attained-service within one request's tokens."""
    fc, detector = controller(capacity=0, fairness=fairness)
    flows = [f"f{i}" for i in range(len(sizes_per_flow))]
    for flow, sizes in zip(flows, sizes_per_flow, strict=True):
        for tokens in sizes:
            fc.enqueue(request(flow=flow, tokens=tokens), 0.0)
    detector.capacity = 10_000
    served = {f: [0, 0] for f in flows}  # requests, tokens
    left = {f: len(s) for f, s in zip(flows, sizes_per_flow, strict=True)}
    biggest = max(max(s) for s in sizes_per_flow)
    for d in fc.poll(1.0, POOL):
        flow = d.request.flow
        served[flow][0] += 1
        served[flow][1] += d.request.tokens
        left[flow] -= 1
        if any(n == 0 for n in left.values()):
            break  # a flow ran dry: from here on the others may take its share
        counts = [served[f][0] for f in flows]
        tokens = [served[f][1] for f in flows]
        if fairness is RoundRobinFairness:
            assert max(counts) - min(counts) <= 1
        else:
            assert max(tokens) - min(tokens) <= biggest
