"""Scrape sharing's pure layer (``epp.sync.scrape_share``) and its wire: capabilities in the
heartbeat, owners among the replicas that announce them, SCRAPES encoded by the owner and applied
by the others as a local scrape would be, and when a replica skips an endpoint or falls back to
scraping it itself. Two replicas on clocks that disagree by hours, exchanging real encoded bytes."""

from __future__ import annotations

import math

import msgpack
import pytest

from epp.datalayer.endpoints import EndpointStore
from epp.load.peer_totals import PeerTotals
from epp.scheduling.types import Endpoint, EngineMetrics
from epp.sync.messages import Capability, MessageKind, SyncMessage, decode, encode, heartbeat_capabilities
from epp.sync.scrape_owners import owner
from epp.sync.scrape_share import ScrapeShare
from epp.sync.state import ReplicaSyncState, SyncTargets
from tests.epp.factories import FakeClock

ENDPOINTS = [f"e{i}" for i in range(12)]
STALE_S = 0.15


class Replica:
    def __init__(
        self, name: str, clock: FakeClock, capabilities: Capability = Capability.SHARES_SCRAPES
    ) -> None:
        self.clock = clock
        self.sync = ReplicaSyncState(
            name, SyncTargets(token_load=PeerTotals()), clock=clock, incarnation=1, capabilities=capabilities
        )
        self.store = EndpointStore()
        self.store.replace([Endpoint(e, "10.0.0.1", 8000 + i) for i, e in enumerate(ENDPOINTS)])
        self.share = ScrapeShare(self.sync, self.store, clock=clock, stale_after_s=STALE_S)


def meet(*replicas: Replica) -> None:
    """Every replica hears every other's heartbeat."""
    for src in replicas:
        beat = src.sync.heartbeat()
        for dst in replicas:
            if dst is not src:
                dst.sync.receive(beat)


@pytest.fixture
def pair() -> tuple[Replica, Replica]:
    a, b = Replica("a", FakeClock(1_000.0)), Replica("b", FakeClock(50_000.0))
    meet(a, b)
    return a, b


def owned_by(name: str) -> list[str]:
    return [e for e in ENDPOINTS if owner(e, ["a", "b"]) == name]


# ---- heartbeat capabilities ----------------------------------------------------------------


def test_the_heartbeat_announces_capabilities_and_an_empty_one_announces_none() -> None:
    clock = FakeClock()
    new = Replica("new", clock)
    old = Replica("old", clock, Capability.NONE)
    beat = decode(new.sync.heartbeat())
    assert beat.body == [1] and heartbeat_capabilities(beat.body) == Capability.SHARES_SCRAPES
    # A replica before scrape sharing sends an empty body: a peer, sharing nothing.
    before = encode(SyncMessage(MessageKind.HEARTBEAT, "older", 7, 0, 0.0, []))
    new.sync.receive(before)
    new.sync.receive(old.sync.heartbeat())
    assert sorted(new.sync.peers) == ["old", "older"]
    assert new.sync.peers_with(Capability.SHARES_SCRAPES) == frozenset()
    assert all(new.share.owns(e) for e in ENDPOINTS)
    # Bits and items of later versions are ignored; a body that is not a bit set is none.
    assert heartbeat_capabilities([1 | 8, "later"]) == Capability.SHARES_SCRAPES
    assert heartbeat_capabilities(["x"]) == heartbeat_capabilities([True]) == Capability.NONE


def test_a_heartbeat_with_capabilities_is_read_by_the_envelope_every_version_4_reader_checks() -> None:
    """Readers before scrape sharing check only the envelope (a list body) and ignore a heartbeat's
    body, so the new heartbeat reaches them as a plain one."""
    data = Replica("a", FakeClock()).sync.heartbeat()
    fields = msgpack.unpackb(data)
    assert fields[0] == 4 and fields[1] == MessageKind.HEARTBEAT and isinstance(fields[6], list)
    reader = Replica("reader", FakeClock(), Capability.NONE)
    assert reader.sync.receive(data) is not None and reader.sync.stats.dropped == {}


def test_owners_follow_the_sharing_peers_as_they_come_and_go(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    assert [e for e in ENDPOINTS if a.share.owns(e)] == owned_by("a")
    assert [e for e in ENDPOINTS if b.share.owns(e)] == owned_by("b")
    assert 0 < len(owned_by("a")) < len(ENDPOINTS)
    # b stops announcing (restarted with --no-sync-share-scrapes): a owns everything again.
    b.sync.capabilities = Capability.NONE
    a.sync.receive(b.sync.heartbeat())
    assert all(a.share.owns(e) for e in ENDPOINTS)
    b.sync.capabilities = Capability.SHARES_SCRAPES
    a.sync.receive(b.sync.heartbeat())
    assert [e for e in ENDPOINTS if a.share.owns(e)] == owned_by("a")
    # b goes silent: a expires it and owns everything.
    a.clock.advance(a.sync.tuning.peer_timeout_s + 0.1)
    a.sync.expire()
    assert all(a.share.owns(e) for e in ENDPOINTS)


# ---- publish and apply -----------------------------------------------------------------------


def test_the_owner_publishes_its_scrapes_and_the_peer_applies_them_with_their_age(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    mine, theirs = owned_by("a")[0], owned_by("b")[0]
    woken: list[int] = []
    a.share.on_pending = lambda: woken.append(1)
    figures = EngineMetrics(2, 5, 0.25, 16, 900, updated_at=a.clock() - 0.01)
    a.share.scraped(mine, EngineMetrics(running=1, updated_at=a.clock() - 0.05), 0.05)
    a.share.scraped(mine, figures, 0.05)
    a.share.scraped(theirs, EngineMetrics(running=9, updated_at=a.clock()), 0.05)  # not a's: not sent
    assert woken == [1]  # once, when the outbox filled
    a.clock.advance(0.02)
    data = a.share.take_message()
    assert data is not None and a.share.take_message() is None
    message = decode(data)
    assert message.kind == MessageKind.SCRAPES and [e[0] for e in message.body] == [mine]  # the latest only
    assert message.body[0][1] == pytest.approx(0.03)

    assert b.share.receive(data) == 1
    state = b.store.by_name(mine)
    assert state is not None and b.store.is_healthy(mine)
    assert (state.metrics.waiting, state.metrics.running, state.metrics.kv_cache_usage) == (2, 5, 0.25)
    assert (state.metrics.block_size, state.metrics.num_gpu_blocks) == (16, 900)
    # Stamped on b's own clock, the scrape's age back, and a sign of life.
    assert state.metrics.updated_at == pytest.approx(b.clock() - 0.03)
    assert b.store.alive_at(mine) == state.metrics.updated_at
    assert b.share.shared_until(mine, b.clock()) == pytest.approx(b.clock() - 0.03 + 0.05 + STALE_S)
    assert (a.share.stats.published, b.share.stats.applied) == (1, 1)


def test_a_replica_alone_publishes_nothing() -> None:
    alone = Replica("a", FakeClock())
    alone.share.scraped("e0", EngineMetrics(updated_at=alone.clock()), 0.05)
    assert alone.share.owns("e0") and alone.share.take_message() is None


def test_a_failure_the_owner_saw_takes_the_endpoint_out_at_the_peer(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    mine = owned_by("a")[0]
    b.store.record_scrape(mine, EngineMetrics(updated_at=b.clock() - 1))
    a.share.scraped(mine, "HTTP 503", 0.05)
    data = a.share.take_message()
    assert data is not None and b.share.receive(data) == 1
    assert not b.store.is_healthy(mine) and b.store.candidates() == []
    assert b.share.shared_until(mine, b.clock()) == pytest.approx(b.clock() + 0.05 + STALE_S)


def test_figures_older_than_those_held_are_dropped(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    mine = owned_by("a")[0]
    b.store.record_scrape(mine, EngineMetrics(running=3, updated_at=b.clock()))  # b's own fallback
    a.share.scraped(mine, EngineMetrics(running=1, updated_at=a.clock() - 0.5), 0.05)
    data = a.share.take_message()
    assert data is not None and b.share.receive(data) == 0
    state = b.store.by_name(mine)
    assert state is not None and state.metrics.running == 3
    assert b.share.stats.dropped == {"older": 1}
    # The owner scrapes on, so b need not: its view is fresh again (or b's fallback scrapes, each
    # newer than the owner's next figures, would go on for good).
    assert b.share.shared_until(mine, b.clock()) == pytest.approx(b.clock() - 0.5 + 0.05 + STALE_S)
    b.clock.advance(0.3)
    b.store.record_scrape(mine, EngineMetrics(running=4, updated_at=b.clock()))  # its next fallback
    a.share.scraped(mine, EngineMetrics(running=1, updated_at=a.clock() - 0.02), 0.05)
    data = a.share.take_message()
    assert data is not None and b.share.receive(data) == 0
    assert b.share.shared_until(mine, b.clock()) > b.clock() and b.share.stats.dropped == {"older": 2}


def envelope(body: list[object], kind: MessageKind = MessageKind.SCRAPES, version: int = 4) -> bytes:
    return msgpack.packb([version, int(kind), "a", 1, 0, 0.0, body])


GOOD = [0, 1, 0.5, 16, None]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (envelope([["e0", 0.0, 0.05, GOOD]], version=5), "version"),
        (b"\xc1 not msgpack", "malformed"),
        (envelope([], kind=MessageKind.HEARTBEAT), "malformed"),
        (envelope(["e0"]), "malformed"),
        (envelope([["e0", -1.0, 0.05, GOOD]]), "malformed"),
        (envelope([["e0", math.inf, 0.05, GOOD]]), "malformed"),
        (envelope([["e0", 0.0, "soon", GOOD]]), "malformed"),
        (envelope([["e0", 0.0, 0.05, [0, 1, 1.5, 16, None]]]), "malformed"),
        (envelope([["e0", 0.0, 0.05, [0, "1", 0.5, 16, None]]]), "malformed"),
        (envelope([["e0", 0.0, 0.05, [0, 1, 0.5, 16]]]), "malformed"),
        (envelope([["e0", 0.0, 0.05, None]]), "malformed"),
        (envelope([["gone", 0.0, 0.05, GOOD]]), "unknown"),
    ],
)
def test_what_cannot_be_applied_is_counted_not_applied(data: bytes, reason: str) -> None:
    b = Replica("b", FakeClock())
    assert b.share.receive(data) == 0
    assert b.share.stats.dropped == {reason: 1}
    assert not any(b.store.is_healthy(e) for e in ENDPOINTS)


def test_the_good_entries_of_a_message_apply_beside_a_bad_one() -> None:
    b = Replica("b", FakeClock())
    assert (
        b.share.receive(envelope([["e0", 0.0, 0.05, GOOD], ["e1", 0.0], ["e2", 0.0, 0.05, "refused"]])) == 2
    )
    assert b.store.is_healthy("e0") and not b.store.is_healthy("e2")
    assert b.share.stats.dropped == {"malformed": 1} and b.share.stats.applied == 2


def test_scrapes_on_the_events_subject_are_refused_by_the_sync_state() -> None:
    b = Replica("b", FakeClock())
    assert b.sync.receive(envelope([["e0", 0.0, 0.05, GOOD]])) is None
    assert b.sync.stats.dropped == {"malformed": 1} and b.sync.peers == []


# ---- skip or scrape --------------------------------------------------------------------------


def test_a_non_owner_skips_while_the_shared_view_is_fresh_then_falls_back(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    mine = owned_by("a")[0]
    # Nothing shared yet: b scrapes it itself, a fallback.
    assert b.share.shared_until(mine, b.clock()) == -math.inf and b.share.stats.fallback == 1
    # The owner idles on its 1 s tick: fresh for 1 s + STALE_S after the scrape.
    a.share.scraped(mine, EngineMetrics(updated_at=a.clock()), 1.0)
    data = a.share.take_message()
    assert data is not None
    b.share.receive(data)
    until = b.share.shared_until(mine, b.clock())
    assert until == pytest.approx(b.clock() + 1.0 + STALE_S) and b.share.stats.fallback == 1
    b.clock.advance(1.0 + STALE_S - 0.001)
    assert b.share.shared_until(mine, b.clock()) > b.clock()
    b.clock.advance(0.002)  # the owner's next scrape did not come: b scrapes
    assert b.share.shared_until(mine, b.clock()) < b.clock() and b.share.stats.fallback == 2
    # Its own endpoints it always scrapes, and never counts as a fallback.
    assert b.share.shared_until(owned_by("b")[0], b.clock()) == -math.inf and b.share.stats.fallback == 2


def test_peers_requests_keep_an_endpoint_busy_and_wake_its_owner(pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    woken: list[str] = []
    a.sync.on_peer_requests = woken.append
    b.sync.routed(1, "e3", kv_tokens=100, uncached_tokens=100, expected_output=10)
    b.sync.routed(2, "e3", kv_tokens=100, uncached_tokens=100, expected_output=10)
    b.sync.routed(3, "e4", kv_tokens=100, uncached_tokens=100, expected_output=10)
    for data in b.sync.take_messages():
        a.sync.receive(data)
    assert a.share.peer_busy("e3") and a.share.peer_busy("e4") and not a.share.peer_busy("e5")
    assert sorted(woken) == ["e3", "e4"]
    b.sync.first_token(1)  # the same requests there: no wake-up
    b.sync.released(3)
    for data in b.sync.take_messages():
        a.sync.receive(data)
    assert sorted(woken) == ["e3", "e4", "e4"] and not a.share.peer_busy("e4")
