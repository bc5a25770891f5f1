"""The pure apply layer of replica sync (``epp.sync.state``), driven by hand and by hypothesis.

Replicas here exchange the real encoded messages through lists standing in for the network,
so every test runs the decode and apply code the live EPP runs."""

from __future__ import annotations

import logging

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvcache.approximate_index import ApproximatePrefixIndex
from epp.load.peer_totals import PeerTotals, pack_tail_rows
from epp.load.token_load import EndpointLoad, TokenLoadTracker
from epp.sync.messages import DeltaKind, MessageKind, SyncMessage, decode, encode
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from tests.epp.factories import FakeClock
from tests.epp.sync_replicas import ENDPOINTS, EppReplica


def make_replica(name: str, clock: FakeClock, incarnation: int = 1, **targets) -> EppReplica:
    targets.setdefault("token_load", PeerTotals())
    sync = ReplicaSyncState(
        name,
        SyncTargets(**targets),
        clock=clock,
        tuning=SyncTuning(peer_timeout_s=3.0),
        incarnation=incarnation,
    )
    return EppReplica(sync)


def send(src: EppReplica) -> list[bytes]:
    src.sync.flush()
    return src.sync.take_messages()


def deliver(messages: list[bytes], *dsts: EppReplica) -> None:
    for data in messages:
        for dst in dsts:
            dst.sync.receive(data)


def serve_snapshots(dst: EppReplica, replicas: dict[str, EppReplica]) -> None:
    for name in dst.sync.wanted_snapshots():
        reply = replicas[name].sync.answer(dst.sync.snapshot_request())
        assert reply is not None
        dst.sync.receive(reply)


def loads(tracker: TokenLoadTracker | PeerTotals) -> dict[str, EndpointLoad]:
    return {e: tracker.load(e) for e in ENDPOINTS}


def totals_sent(messages: list[bytes]) -> list[str]:
    """The endpoints of the TOTALS deltas in ``messages``, in order."""
    return [d[1] for m in messages for d in decode(m).body if d[0] == DeltaKind.TOTALS]


def test_a_peer_sees_each_endpoints_totals_and_the_release() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    key = a.route("a", prompt=1000, cached=600, expected=50)
    deliver(send(a), b)
    assert b.peers_load.load("a") == EndpointLoad(1, 400, 0, 50, 1000) == a.own.load("a")
    a.first_token(key)
    a.progress(key, 7)
    a.progress(key, 9)  # all three coalesced: one TOTALS delta for the endpoint
    messages = send(a)
    assert totals_sent(messages) == ["a"]
    deliver(messages, b)
    assert b.peers_load.load("a") == a.own.load("a") == EndpointLoad(1, 0, 1009, 41, 1009)
    assert b.sync.stats.applied == {"totals": 2} and b.sync.peer_bookings("a") == 1
    a.release(key)
    deliver(send(a), b)
    assert b.peers_load.load("a") == EndpointLoad() and b.peers_load.in_flight() == 0
    assert a.sync.stats.sent == {"totals": 3} and b.sync.peer_bookings("a") == 0


def test_an_endpoint_goes_out_once_per_take_however_many_requests_change_it() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    keys = [a.route("a", 100, 0, 10) for _ in range(5)]
    a.route("b", 100, 0, 10)
    for key in keys:
        a.first_token(key)
    a.release(keys[0])
    first = a.sync.take_messages()
    assert totals_sent(first) == ["a", "b"]  # each once, as it is at the take
    deliver(first, b)
    assert loads(b.peers_load) == loads(a.own)
    for key in keys[1:]:
        a.progress(key, 5)
    assert a.sync.take_messages() == []  # decode progress waits for the tick
    a.sync.flush()
    messages = a.sync.take_messages()
    assert totals_sent(messages) == ["a"]
    deliver(messages, b)
    assert loads(b.peers_load) == loads(a.own)
    assert a.sync.stats.sent == {"totals": 3}


def test_duplicates_are_dropped_and_counted() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    a.route("b", 100, 0, 10)
    a.route("b", 50, 0, 10)
    messages = send(a)
    deliver(messages + messages, b)
    assert b.peers_load.load("b") == a.own.load("b")
    assert b.sync.stats.dropped["duplicate"] == 1  # one TOTALS delta: "b" with both


def test_own_messages_are_ignored() -> None:
    clock = FakeClock()
    a = make_replica("a", clock)
    a.route("a", 100, 0, 10)
    deliver(send(a), a)
    assert a.peers_load.in_flight() == 0 and a.sync.peers == []


def test_a_message_of_another_schema_version_is_refused_and_logged_once(caplog) -> None:
    clock = FakeClock()
    b = make_replica("b", clock)
    future = msgpack.packb([5, 1, "a", 1, 1, 0.0, [[6, "a", 1, 0, 0, 1, 1, None, b""]], {"new": "field"}])
    with caplog.at_level(logging.WARNING, logger="epp.sync.state"):
        assert b.sync.receive(future) is None
        assert b.sync.receive(future) is None
    assert b.sync.stats.dropped["version"] == 2
    assert b.peers_load.in_flight() == 0 and b.sync.peers == []
    assert len([r for r in caplog.records if "schema version 5" in r.getMessage()]) == 1
    assert b.sync.receive(b"\xc1 not msgpack") is None
    assert b.sync.stats.dropped["malformed"] == 1


def test_a_malformed_delta_is_dropped_and_the_rest_of_its_message_applied() -> None:
    clock = FakeClock()
    b = make_replica("b", clock)
    deltas = [
        [DeltaKind.TOTALS, "a", "many", 10, 0, 10, 100, None, b""],  # a string where a count belongs
        [DeltaKind.TOTALS, "b", 1, 40, 0, 10, 100, -5.0, b""],  # a TPOT SLO that is no SLO
        [DeltaKind.TOTALS, "c", 1, 40, 0, 10, 100, None, b"\x01" * 47],  # tail rows not whole
        [DeltaKind.TOTALS, "a", 1, 40, 0, 10, 100, None, b""],
        [99, 2],  # a kind this version does not know
        [1, 2, "a", 100, 40, 10, None, None],  # version 3's ROUTED
        [DeltaKind.TOTALS, "a", 1, 40],  # too short
    ]
    b.sync.receive(encode(SyncMessage(MessageKind.DELTAS, "a", 1, 1, 0.0, deltas)))
    assert loads(b.peers_load) == {
        "a": EndpointLoad(1, 40, 0, 10, 100),
        "b": EndpointLoad(),
        "c": EndpointLoad(),
    }
    assert b.sync.stats.dropped["malformed"] == 6 and b.sync.stats.applied["totals"] == 1


def test_a_gap_is_repaired_with_a_snapshot_and_the_messages_after_it() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    replicas = {"a": a, "b": b}
    first = a.route("a", 100, 0, 10)
    deliver(send(a), b)
    a.first_token(first)
    lost = send(a)  # never arrives
    second = a.route("b", 200, 50, 20)
    deliver(send(a), b)  # seq 3 after seq 1: a gap
    assert b.sync.stats.gaps == 1
    # Until the snapshot comes, what arrives is applied (best effort): the second booking shows.
    assert b.peers_load.load("b") == a.own.load("b")
    a.release(second)
    after_snapshot = send(a)
    serve_snapshots(b, replicas)
    deliver(after_snapshot, b)
    assert loads(b.peers_load) == loads(a.own)
    assert b.sync.stats.snapshots["installed"] == 1 and len(lost) == 1


def test_messages_kept_during_a_resync_that_the_snapshot_covers_are_not_applied_again() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    a.route("a", 1, 0, 1)
    send(a)  # lost: b waits for a snapshot from here on
    key = a.route("b", 100, 0, 10)
    deliver(send(a), b)  # kept, and applied meanwhile
    a.release(key)
    send(a)  # lost too
    assert b.peers_load.load("b").requests == 1
    serve_snapshots(b, {"a": a})
    assert loads(b.peers_load) == loads(a.own)
    assert b.sync.stats.dropped["superseded"] == 1


def test_a_heartbeat_shows_lost_trailing_messages() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    deliver([a.sync.heartbeat()], b)
    key = a.route("a", 100, 0, 10)
    deliver(send(a), b)
    a.release(key)
    send(a)  # lost: b still sees the booking
    assert b.peers_load.in_flight() == 1
    deliver([a.sync.heartbeat()], b)
    assert b.sync.wanted_snapshots() == ["a"]
    b.sync.receive(a.sync.answer(b.sync.snapshot_request()))
    assert b.peers_load.in_flight() == 0


def test_a_replica_that_joins_mid_stream_converges_with_a_snapshot() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    keys = [a.route(e, 100 * (i + 1), 10, 5) for i, e in enumerate(ENDPOINTS)]
    a.first_token(keys[0])
    a.progress(keys[0], 4)
    send(a)  # published before b existed
    late = make_replica("late", clock)
    a.release(keys[1])
    deliver(send(a), b, late)
    assert late.sync.wanted_snapshots() == ["a"]
    assert late.sync.wanted_snapshots() == []  # asked once until answered or failed
    late.sync.snapshot_failed("a")
    serve_snapshots(late, {"a": a})
    assert loads(late.peers_load) == loads(a.own)


def test_a_silent_peer_is_dropped_with_all_it_booked_but_not_while_disconnected() -> None:
    clock = FakeClock()
    a, b, c = make_replica("a", clock), make_replica("b", clock), make_replica("c", clock)
    a.route("a", 100, 0, 10)
    c.route("a", 300, 0, 10)
    deliver(send(a), b)
    deliver(send(c), b)
    assert b.peers_load.load("a").kv_tokens == 400
    b.sync.connection_lost()
    clock.advance(10)
    assert b.sync.expire() == []
    assert b.peers_load.load("a").kv_tokens == 400  # routing goes on with the last known state
    b.sync.connection_restored()
    assert sorted(b.sync.wanted_snapshots()) == ["a", "c"]
    clock.advance(2)
    deliver([c.sync.heartbeat()], b)
    clock.advance(2)
    assert b.sync.expire() == ["a"]
    assert b.peers_load.load("a").kv_tokens == 300 and b.sync.peers == ["c"]
    assert b.peers_load.in_flight() == 1 and b.sync.peer_bookings("a") == 0


def test_a_restarted_peer_replaces_its_old_incarnation() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    a.route("a", 100, 0, 10)
    deliver(send(a), b)
    restarted = make_replica("a", clock, incarnation=2)
    restarted.route("b", 7, 0, 1)
    deliver(send(restarted), b)
    assert b.peers_load.load("a") == EndpointLoad() and b.peers_load.load("b").kv_tokens == 7
    deliver([a.sync.heartbeat()], b)  # a late message of the dead incarnation
    assert b.sync.stats.dropped["stale_incarnation"] == 1


def test_two_replicas_with_one_name_are_told_apart_and_refused(caplog) -> None:
    clock = FakeClock()
    a, twin = make_replica("a", clock, incarnation=1), make_replica("a", clock, incarnation=2)
    twin.route("a", 100, 0, 10)
    with caplog.at_level(logging.WARNING, logger="epp.sync.state"):
        deliver(send(twin), a)
    assert a.peers_load.in_flight() == 0 and a.sync.stats.dropped["replica_id_conflict"] == 1
    assert any("--replica-id" in r.getMessage() for r in caplog.records)


def test_prefix_inserts_and_tpot_slos_reach_the_peer_structures() -> None:
    clock = FakeClock()
    index = ApproximatePrefixIndex()
    slos: dict = {}
    a = make_replica("a", clock)
    b = make_replica(
        "b",
        clock,
        tpot_slos=slos,
        record_prefix=lambda endpoint, hashes: index.record(endpoint, hashes, 100),
        prefix_block_size=64,
    )
    hashes = [2**64 - 1, 5, 7]
    key = a.route("c", 100, 0, 10, slo=40.0)
    a.sync.prefix_inserted("c", 64, hashes)
    a.sync.prefix_inserted("a", 16, hashes)  # another block size: not comparable, dropped
    deliver(send(a), b)
    assert index.longest_prefix(hashes) == {"c": 3}
    assert list(slos["c"].values()) == [40.0]
    assert b.sync.stats.dropped["block_size"] == 1
    a.route("c", 100, 0, 10, slo=25.0)
    a.route("c", 100, 0, 10)  # streaming without an SLO: binds nothing
    deliver(send(a), b)
    assert list(slos["c"].values()) == [25.0]  # the peer's smallest, all the headroom reads
    a.release(key)
    a.release(key + 1)
    deliver(send(a), b)
    assert slos["c"] == {}


def test_a_silent_peers_tpot_slos_leave_with_it() -> None:
    clock = FakeClock()
    slos: dict = {}
    a, b = make_replica("a", clock), make_replica("b", clock, tpot_slos=slos)
    a.route("c", 100, 0, 10, slo=40.0)
    deliver(send(a), b)
    clock.advance(4)
    assert b.sync.expire() == ["a"] and slos["c"] == {} and b.peers_load.in_flight() == 0


def test_a_joining_replica_gets_the_most_recent_prefix_blocks_in_a_snapshot_within_the_bound() -> None:
    clock = FakeClock()
    index_a, index_late = ApproximatePrefixIndex(), ApproximatePrefixIndex()
    a = make_replica(
        "a", clock, prefix_block_size=64, prefix_blocks=index_a.recent_blocks, record_prefix=None
    )
    a.sync.tuning = SyncTuning(snapshot_prefix_blocks=6)
    late = make_replica(
        "late",
        clock,
        prefix_block_size=64,
        record_prefix=lambda endpoint, hashes: index_late.record(endpoint, hashes, 100),
    )
    old_prompt, new_prompt, other = [1, 2, 3, 4], [11, 12, 13], [21, 22]
    index_a.record("a", old_prompt, 100)
    index_a.record("a", new_prompt, 100)
    index_a.record("b", other, 100)  # a peer's insert that a applied: a snapshot carries it too
    a.route("a", 100, 0, 10)
    send(a)  # published before late existed
    a.route("b", 100, 0, 10)
    deliver(send(a), late)
    serve_snapshots(late, {"a": a})
    # 6 blocks in all, 3 per endpoint, the most recent of each, in LRU order.
    assert index_late.longest_prefix(new_prompt) == {"a": 3}
    assert index_late.longest_prefix(other) == {"b": 2}
    assert index_late.longest_prefix(old_prompt) == {}
    assert index_late.blocks_held("a") == 3 and late.peers_load.load("a").requests == 1


def test_a_malformed_snapshot_is_refused_and_asked_for_again() -> None:
    clock = FakeClock()
    late = make_replica("late", clock)
    late.sync.receive(encode(SyncMessage(MessageKind.DELTAS, "a", 1, 5, 0.0, [])))
    assert late.sync.wanted_snapshots() == ["a"]
    old_shape = encode(SyncMessage(MessageKind.SNAPSHOT, "a", 1, 5, 0.0, [[1, "a", 1, 1, 1, None, False, 0]]))
    assert late.sync.receive(old_shape) is None
    late.sync.snapshot_failed("a")
    assert late.sync.stats.dropped["malformed"] == 1 and late.sync.wanted_snapshots() == ["a"]
    bad_blocks = [[], [["a", 64, b"\x01\x02\x03"]]]  # hashes not whole uint64s
    assert late.sync.receive(encode(SyncMessage(MessageKind.SNAPSHOT, "a", 1, 5, 0.0, bad_blocks)))
    assert late.sync.stats.dropped["malformed"] == 2 and late.sync.stats.snapshots["installed"] == 1


def test_large_batches_are_split_under_the_message_size_limit() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    for i in range(40):
        a.route("a", 10, 0, 1)
        a.sync.prefix_inserted("a", 64, list(range(i * 2048, (i + 1) * 2048)))
    messages = send(a)
    assert len(messages) > 1 and all(len(m) <= a.sync.tuning.max_message_bytes + 20_000 for m in messages)
    deliver(messages, b)
    assert b.peers_load.load("a").requests == 40 and b.sync.stats.gaps == 0


# ---- hypothesis: any interleaving of bookings, loss, duplication and reordering converges --

replica_names = st.sampled_from(["r0", "r1", "r2"])
deliveries = st.tuples(
    st.just("deliver"),
    replica_names,
    replica_names,
    st.sampled_from(["in_order", "in_order", "duplicate", "lose", "swap"]),
)
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("route"),
            replica_names,
            st.sampled_from(ENDPOINTS),
            st.integers(1, 500),
            st.integers(0, 600),
            st.integers(0, 50),
        ),
        st.tuples(st.just("first"), replica_names, st.integers(0, 20)),
        st.tuples(st.just("progress"), replica_names, st.integers(0, 20), st.integers(1, 80)),
        st.tuples(st.just("release"), replica_names, st.integers(0, 20)),
        st.tuples(st.just("flush"), replica_names),
        deliveries,
        deliveries,
        deliveries,
        st.tuples(st.just("snapshots"), replica_names),
    ),
    min_size=10,
    max_size=120,
)


def reference_load(bookings: dict[int, dict]) -> dict[str, EndpointLoad]:
    """The plain model: per endpoint, the sum of the live bookings' accounts."""
    totals = {e: [0, 0, 0, 0, 0] for e in ENDPOINTS}
    for b in bookings.values():
        acc = totals[b["endpoint"]]
        kv = b["prompt"] + b["generated"]
        acc[0] += 1
        acc[1] += 0 if b["decoding"] else b["uncached"]
        acc[2] += kv if b["decoding"] else 0
        acc[3] += max(0, max(b["expected"], b["generated"]) - b["generated"])
        acc[4] += kv
    return {e: EndpointLoad(*v) for e, v in totals.items()}


@settings(max_examples=300, deadline=None)
@given(operations)
def test_every_replica_converges_on_the_sum_of_its_peers_live_bookings(ops) -> None:
    clock = FakeClock()
    replicas = {name: make_replica(name, clock) for name in ("r0", "r1", "r2")}
    live: dict[str, dict[int, dict]] = {name: {} for name in replicas}
    wire: dict[tuple[str, str], list[bytes]] = {(s, d): [] for s in replicas for d in replicas if s != d}
    for op in ops:
        kind, name = op[0], op[1]
        r, mine = replicas[name], live[name]
        keys = sorted(mine)
        if kind == "route":
            _, _, endpoint, prompt, cached, expected = op
            key = r.route(endpoint, prompt, cached, expected)
            uncached = max(0, prompt - min(cached, prompt))
            mine[key] = dict(
                endpoint=endpoint, prompt=prompt, uncached=uncached, expected=max(1, expected), generated=0,
                decoding=False,
            )  # fmt: skip
        elif kind in ("first", "progress", "release") and keys:
            key = keys[op[2] % len(keys)]
            if kind == "first":
                r.first_token(key)
                if not mine[key]["decoding"]:
                    mine[key]["decoding"] = True
                    mine[key]["generated"] = max(1, mine[key]["generated"])
            elif kind == "progress":
                r.progress(key, op[3])
                mine[key]["generated"] = max(mine[key]["generated"], op[3])
            else:
                r.release(key)
                del mine[key]
        elif kind == "flush":
            r.sync.flush()
        elif kind == "deliver" and op[1] != op[2] and (queue := wire[(op[1], op[2])]):
            mode = op[3]
            if mode == "swap" and len(queue) > 1:
                queue[0], queue[1] = queue[1], queue[0]
            data = queue.pop(0)
            if mode != "lose":
                replicas[op[2]].sync.receive(data)
            if mode == "duplicate":
                replicas[op[2]].sync.receive(data)
        elif kind == "snapshots":
            serve_snapshots(r, replicas)
        # Each step's totals leave in a message of their own (unless their endpoint already went
        # out at once this tick, or it is progress: then once flushed).
        for data in r.sync.take_messages():
            for dst in replicas:
                if dst != name:
                    wire[(name, dst)].append(data)
        assert r.own.load("a") == reference_load(mine)["a"]
    # The network settles: everything still queued arrives in order, then a heartbeat round
    # reveals lost tail messages, and the snapshots asked for are served.
    for name, r in replicas.items():
        for data in send(r):
            for dst in replicas:
                if dst != name:
                    wire[(name, dst)].append(data)
    for (src, dst), queue in wire.items():
        deliver(queue, replicas[dst])
        deliver([replicas[src].sync.heartbeat()], replicas[dst])
    for r in replicas.values():
        serve_snapshots(r, replicas)
    for name, r in replicas.items():
        expected = {e: EndpointLoad() for e in ENDPOINTS}
        for peer in replicas:
            if peer != name:
                expected = {e: expected[e] + reference_load(live[peer])[e] for e in ENDPOINTS}
        assert loads(r.peers_load) == expected
        assert r.peers_load.in_flight() == sum(len(live[p]) for p in replicas if p != name)


def test_a_bookings_prompt_tail_reaches_peers_by_delta_and_by_snapshot() -> None:
    clock = FakeClock()
    a, b, late = make_replica("a", clock), make_replica("b", clock), make_replica("late", clock)
    tail = (1 << 64) - 1  # any uint64
    a.sync.routed(0, "e0", kv_tokens=320, uncached_tokens=320, expected_output=30, prompt_tail=tail)
    deliver(send(a), b)
    assert b.peers_load.has_tails() and b.peers_load.load("e0").requests == 1
    a.sync.routed(1, "e0", kv_tokens=160, uncached_tokens=160, expected_output=30)  # no tail known
    deliver(send(a), late)  # late sees a mid-stream and converges with a snapshot
    serve_snapshots(late, {"a": a})
    assert late.peers_load.in_flight() == 2
    assert not late.peers_load.continue_turn("e0", tail, 320)  # not longer: not a next turn
    assert late.peers_load.continue_turn("e0", tail, 400)
    assert late.peers_load.load("e0") == EndpointLoad(1, 160, 0, 30, 160) and late.peers_load.in_flight() == 1


def test_tail_rows_carry_each_bookings_load() -> None:
    clock = FakeClock()
    b = make_replica("b", clock)
    rows = pack_tail_rows([(7, 300, 0, 310, 20, 310), (8, 100, 100, 0, 5, 100)])
    totals = [DeltaKind.TOTALS, "e0", 2, 100, 310, 25, 410, None, rows]
    b.sync.receive(encode(SyncMessage(MessageKind.DELTAS, "a", 1, 1, 0.0, [totals])))
    assert b.peers_load.continue_turn("e0", 7, 1000)
    assert b.peers_load.load("e0") == EndpointLoad(1, 100, 0, 5, 100)


def test_a_tail_row_follows_its_booking_to_decode_and_its_progress_at_the_tick() -> None:
    clock = FakeClock()
    a, b = make_replica("a", clock), make_replica("b", clock)
    a.sync.routed(0, "e0", kv_tokens=320, uncached_tokens=200, expected_output=30, prompt_tail=7)
    a.sync.first_token(0)
    a.sync.progress(0, 12)
    deliver(send(a), b)  # send() flushes: the tick
    assert b.peers_load.load("e0") == EndpointLoad(1, 0, 332, 18, 332)
    assert b.peers_load.continue_turn("e0", 7, 400)
    assert b.peers_load.load("e0") == EndpointLoad() and b.peers_load.in_flight() == 0
