"""Pool-wide token load: a replica's flow control counts its peers' synced bookings and keeps its
1/K share of the headroom, K following the peers alive (``epp.flowcontrol.peers``)."""

from __future__ import annotations

import pytest

from epp.flowcontrol.controller import FlowController, FlowSettings
from epp.flowcontrol.fairness import RoundRobinFairness
from epp.flowcontrol.ordering import FcfsOrdering
from epp.flowcontrol.peers import PeerTokenLoad
from epp.flowcontrol.saturation import TokenLoadSaturationDetector
from epp.flowcontrol.types import Outcome
from epp.load.peer_totals import PeerTotals
from epp.scheduling.framework import CycleState
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from tests.epp.factories import FakeClock, endpoint_state
from tests.epp.flowcontrol.helpers import policy, request
from tests.epp.sync_replicas import EppReplica

POOL = [endpoint_state(0)]  # "e0", room for 1000 tokens


def replica(name: str, clock: FakeClock, *, token_load: bool = True) -> EppReplica:
    targets = SyncTargets(token_load=PeerTotals() if token_load else None)
    return EppReplica(ReplicaSyncState(name, targets, clock=clock, tuning=SyncTuning(peer_timeout_s=1.0)))


def deliver(src: EppReplica, dst: EppReplica) -> None:
    for data in src.sync.take_messages():
        dst.sync.receive(data)


def controller() -> FlowController:
    detector = policy(TokenLoadSaturationDetector, maxTokensPerEndpoint=1000)
    return FlowController(FlowSettings(), policy(RoundRobinFairness), policy(FcfsOrdering), [detector])  # type: ignore[arg-type]


def dispatch_one(fc: FlowController, tokens: int, now: float) -> list[Outcome]:
    """Enqueue a request of ``tokens``; route it to e0 if it goes at once. Its outcomes so far."""
    item = request(tokens=tokens)
    decisions = fc.enqueue(item, now) + fc.poll(now, POOL)
    mine = [d.outcome for d in decisions if d.request is item]
    if mine == [Outcome.DISPATCHED]:
        fc.routed(item.key, "e0", CycleState(), now)
    return mine


def test_a_peers_synced_bookings_saturate_the_pool_earlier_until_it_releases_them() -> None:
    clock = FakeClock()
    ours, peer = replica("a", clock), replica("b", clock)
    alone, shared = controller(), controller()
    shared.peers = PeerTokenLoad(ours.sync)
    for fc in (alone, shared):
        assert dispatch_one(fc, 300, clock()) == [Outcome.DISPATCHED]

    key = peer.route("e0", prompt=700, cached=0, expected=100)  # 800 tokens on e0 from the peer
    deliver(peer, ours)
    # On its own the replica sees 700 tokens of room; with the peer's 800 the pool has none, and
    # its own share (half of 1000, less its 300) is short of another 300.
    assert dispatch_one(alone, 300, clock()) == [Outcome.DISPATCHED]
    assert dispatch_one(shared, 300, clock()) == []
    assert shared.saturated and len(shared) == 1

    peer.release(key)
    deliver(peer, ours)
    [decision] = shared.poll(clock(), POOL)
    assert decision.outcome is Outcome.DISPATCHED and len(shared) == 0


def test_the_share_follows_the_peers_alive() -> None:
    clock = FakeClock()
    ours, b, c = replica("a", clock), replica("b", clock), replica("c", clock)
    peers = PeerTokenLoad(ours.sync)
    assert peers.read(POOL).replicas == 1
    for peer in (b, c):
        ours.sync.receive(peer.sync.heartbeat())
    assert peers.read(POOL).replicas == 3

    fc = controller()
    fc.peers = peers
    c.route("e0", prompt=600, cached=0, expected=100)  # 700 of e0's 1000 tokens
    deliver(c, ours)
    assert dispatch_one(fc, 300, clock()) == [Outcome.DISPATCHED]  # the pool's last 300
    # No room left in the pool, and this replica's third (333) holds only 33 more.
    assert dispatch_one(fc, 150, clock()) == []

    # c keeps beating, b goes silent: two replicas share the pool now, and half of it is 500.
    clock.advance(0.6)
    ours.sync.receive(c.sync.heartbeat())
    clock.advance(0.6)
    assert ours.sync.expire() == ["b"]
    assert peers.read(POOL) == ({"e0": 700}, {"e0": 600}, 2)
    [decision] = fc.poll(clock(), POOL)
    assert decision.outcome is Outcome.DISPATCHED


def test_pool_wide_load_needs_the_token_load_producers_peer_tracker() -> None:
    with pytest.raises(ValueError, match="token-load-producer"):
        PeerTokenLoad(replica("a", FakeClock(), token_load=False).sync)
