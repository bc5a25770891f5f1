"""The pure apply layer of replica sync: no I/O, no threads, time from injected clocks.

One :class:`ReplicaSyncState` per EPP replica. It does two jobs:

* **Outbound.** The replica's pipeline hook (``epp.sync.hook``) reports the lifecycle of every
  request this replica routes (routed, prefix blocks inserted, first token, decode progress,
  released). The state keeps its own bookings' totals per endpoint and publishes, for each
  endpoint whose totals changed, the totals themselves (absolute values, not the change): with
  the next :meth:`take_messages` when a request is routed, starts decoding or ends there, and at
  the next :meth:`flush` (the tick) for decode progress. However many requests change an
  endpoint between two takes, it goes out once, as it is at the take; the live transport takes
  at most every ``publish_interval_s``, so an endpoint goes out at most 1 / publish_interval_s
  + 1 / progress_interval_s times a second. Prefix inserts go out as they come (the same blocks
  twice in one take, once). Messages are numbered per incarnation.
* **Inbound.** Messages from peers (:meth:`receive`) are applied to the structures the local
  plugins read (``SyncTargets``): a peer's totals for an endpoint replace what was held of that
  peer there (the token-load producer's ``peers``, :class:`~epp.load.peer_totals.PeerTotals`,
  and, for the predicted-latency producer's running TPOT SLOs, the peer's smallest SLO there,
  which is all its headroom reads); prefix inserts go to the approximate prefix index. Local
  decisions read whatever has arrived; nothing here waits. A replica's apply work is therefore
  bounded by endpoints × peers × take and tick rates, whatever the pool's request rate
  (``llm-epp-bench sync-apply``).

API (the live transport ``epp.sync.nats_transport`` and the fleet simulator both drive it)::

    state = ReplicaSyncState("epp-0", sync_targets(pipeline), clock=clock, tuning=SyncTuning())
    attach_replica_sync(pipeline, state, context)   # epp.sync.hook: feeds the lifecycle in
    state.on_pending = wake                         # optional: called when the outbox fills

    # every tuning.progress_interval_s:
    state.flush()                                   # queue the endpoints' coalesced totals
    # whenever on_pending fired (the live transport: on the next loop turn, at most every
    # tuning.publish_interval_s):
    for data in state.take_messages(): deliver data to every peer, in order
    # every tuning.heartbeat_interval_s, after take_messages():
    deliver state.heartbeat() to every peer
    state.expire()                                  # drop peers silent for peer_timeout_s
    for peer in state.wanted_snapshots():           # joins, gaps, restarts, reconnects
        reply = <peer's state>.answer(state.snapshot_request())   # request/reply
        if reply is None or state.receive(reply) is None: state.snapshot_failed(peer)
    # when ``data`` arrives from a peer (after whatever delay):
    state.receive(data)                             # -> Received(kind, replica, lag_s) | None
    # the live transport only: state.connection_lost() / state.connection_restored()
    # a message it could not send: state.unsent(data)

Introspection: ``state.peers`` (names), ``peer_bookings(name)``, ``own_bookings()``, ``stats``
(:class:`SyncStats`). The peers' load itself is read where scoring reads it: the token-load
producer's ``peers`` (``targets.token_load``). For scrape sharing (``epp.sync.scrape_share``):
``peers_with(capability)`` (the peers whose latest heartbeat announced it; ours, ``capabilities``,
go out in every heartbeat), ``peer_requests(endpoint)``, and ``on_peer_requests(endpoint)``,
called when a peer's request count there changed. For estimated token ids calibrated on the
tokenizer (``epp.tokenizer.sampling``): ``bytes_per_token`` (ours, announced in every heartbeat)
and ``agreed_bytes_per_token()``.

Everything delivered is bytes in the ``epp.sync.messages`` schema, so a simulator that delays
``data`` by d exercises the same decode and apply code as the live EPP. Applying a TOTALS delta
is O(peers) (a sum over them; its tail rows are kept as bytes), a prefix insert O(blocks);
publishing an endpoint's totals is O(our bookings there); :meth:`expire` is O(peers), dropping a
peer and installing a snapshot O(endpoints + its prefix blocks) and answering one O(our bookings
+ ``snapshot_prefix_blocks``).

Consistency rules:

* A peer's messages apply in ``seq`` order. A duplicate (``seq`` already applied) is dropped. A
  gap (a ``seq`` skipped, or a heartbeat announcing a ``seq`` never seen) means messages were
  lost: the state asks that peer for a snapshot (:meth:`wanted_snapshots`) and, until it comes,
  keeps applying what arrives (best effort) while also keeping it; the snapshot then replaces
  the bookings it knew of that peer (its prefix blocks are merged into the index, which does not
  tell whose insert a block was), and the kept messages numbered after the snapshot replay.
* Totals are absolute, so applying one twice, or one that a snapshot already includes, changes
  nothing.
* A peer heard from for the first time mid-stream (its first message is not its first ever) is
  asked for a snapshot too: that is how a replica that starts or restarts converges (on the
  bookings, and on the most recent part of the prefix index, which a snapshot also carries).
* A peer silent for ``peer_timeout_s`` is dropped with everything it published. A peer that starts
  a new incarnation (a restart under the same name) has its old incarnation dropped at once.
* While the transport is disconnected (:meth:`connection_lost`) nobody expires: routing goes on
  with the last known remote state. On :meth:`connection_restored` every peer is re-snapshotted
  and gets a fresh ``peer_timeout_s``.

Replicas of one pool are assumed to run the same EndpointPickerConfig: a prefix insert is applied
only when its block size equals the local index's, and a structure missing locally is skipped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from epp.load.peer_totals import TAIL_ROW_BYTES, Counts, PeerTotals, pack_tail_row
from epp.load.token_load import TokenLoadTracker
from epp.sync.messages import (
    Capability,
    DeltaKind,
    MessageKind,
    SchemaError,
    SyncMessage,
    decode,
    delta_name,
    encode,
    heartbeat_bytes_per_token,
    heartbeat_capabilities,
    pack_hashes,
    unpack_hashes,
)

log = logging.getLogger(__name__)
_DELTA_OVERHEAD_BYTES = 64
"""A generous estimate of one delta's encoded size, apart from its packed bytes."""


@dataclass(frozen=True, slots=True)
class SyncTuning:
    progress_interval_s: float = 0.05
    """The sync tick: how often the endpoints whose decode progress changed are published."""
    publish_interval_s: float = 0.005
    """The live transport takes messages at most this often: what changed meanwhile goes out
    once per endpoint, which bounds what peers apply however busy the pool is."""
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 3.0
    """A peer silent this long is dropped with all it booked."""
    max_message_bytes: int = 256 << 10
    """DELTAS messages are split past about this size (NATS refuses payloads over its
    max_payload, 1 MiB by default)."""
    max_kept_messages: int = 10_000
    """Messages kept per peer while its snapshot is awaited; past it they are dropped."""
    snapshot_prefix_blocks: int = 65_536
    """Approximate-prefix-index blocks a snapshot carries at most (8 bytes each, the most recent
    of each endpoint), so a replica that joins scores prefixes before it has seen any insert."""


@dataclass(slots=True)
class SyncTargets:
    """The local structures that peers' deltas are applied to (None: this replica has none)."""

    token_load: PeerTotals | None = None
    """Peers' load only (the token-load producer adds it to its own at read time)."""
    tpot_slos: dict[str, dict[Hashable, float]] | None = None
    """The predicted-latency producer's running TPOT SLOs, per endpoint, per booking (a peer's
    smallest under its ``_Peer.slo_key``)."""
    record_prefix: Callable[[str, list[int]], None] | None = None
    """Record that an endpoint was sent these prompt blocks (the approximate prefix index)."""
    prefix_block_size: int = 0
    prefix_blocks: Callable[[int], list[tuple[str, list[int]]]] | None = None
    """The approximate prefix index's most recent blocks per endpoint, oldest first, at most this
    many in all (what a snapshot carries)."""


@dataclass(slots=True)
class SyncStats:
    """Counts for metrics. Deltas are counted one by one; a message refused whole counts once."""

    sent: Counter[str] = field(default_factory=Counter)
    """Deltas handed out by :meth:`ReplicaSyncState.take_messages`, by kind (``totals``, ``prefix``)."""
    applied: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    """By reason: duplicate, superseded (covered by a snapshot), version, malformed, stale_incarnation,
    replica_id_conflict, block_size, unused (no prefix index here), kept_overflow (applied, but
    too many to keep for replay after a snapshot), and unsent (ours, that the transport could not send)."""
    gaps: int = 0
    snapshots: Counter[str] = field(default_factory=Counter)
    """requested, installed, stale, failed (asked of peers); served (answered to peers)."""
    expired_peers: int = 0


class Received(NamedTuple):
    """What :meth:`ReplicaSyncState.receive` took in."""

    kind: MessageKind
    replica: str
    lag_s: float
    """Receiver's wall clock minus the sender's at sending (clock skew included)."""


class _Own(NamedTuple):
    endpoint: str
    tpot_slo_ms: float | None
    prompt_tail: int | None


@dataclass(slots=True)
class _Peer:
    replica: str
    incarnation: int
    index: int
    """Names this incarnation in the shared structures' booking keys."""
    last_heard: float
    last_seq: int = 0
    totals: dict[str, Counts] = field(default_factory=dict)
    """What the peer last published per endpoint where it has bookings."""
    kept: list[SyncMessage] | None = None
    """DELTAS messages kept for replay while a snapshot is awaited (None: in sync)."""
    asked: bool = False
    """The awaited snapshot was handed to the transport to request."""
    slo_key: tuple[str, int] = ("peer", -1)
    """The peer's key among the bookings of the running TPOT SLOs."""
    capabilities: Capability = Capability.NONE
    """What its latest heartbeat announced (none until one came)."""
    bytes_per_token: float | None = None
    """The estimate's ratio its latest heartbeat announced (``epp.tokenizer.sampling``)."""

    def __post_init__(self) -> None:
        self.slo_key = ("peer", self.index)


class ReplicaSyncState:
    def __init__(
        self,
        replica_id: str,
        targets: SyncTargets,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] | None = None,
        tuning: SyncTuning | None = None,
        incarnation: int | None = None,
        capabilities: Capability = Capability.NONE,
    ) -> None:
        """``clock`` times heartbeats (monotonic seconds); ``wall_clock`` stamps messages for the
        lag (seconds since the epoch; default ``clock``). ``incarnation`` tells this process's life
        from an earlier one under the same ``replica_id``; a later life must have a larger one
        (default: ``wall_clock()`` in microseconds). ``capabilities`` go out in every heartbeat."""
        self.replica_id = replica_id
        self.targets = targets
        self.clock = clock
        self.wall_clock = wall_clock or clock
        self.tuning = tuning or SyncTuning()
        self.incarnation = incarnation if incarnation is not None else int(self.wall_clock() * 1e6)
        self.capabilities = capabilities
        self.stats = SyncStats()
        self.on_pending: Callable[[], None] | None = None
        """Called when the outbox goes from empty to not empty (the transport's wake-up)."""
        self.on_peer_freed: Callable[[], None] | None = None
        """Called when a peer published fewer requests or less prefill on an endpoint than before
        (its load went down: flow control's wake-up)."""
        self.on_peer_requests: Callable[[str], None] | None = None
        """Called with an endpoint where a peer published another number of requests than before
        (it routed there or saw one end: the scraper's wake-up, as for this replica's own)."""
        self.bytes_per_token: Callable[[], float | None] = lambda: None
        """Our estimate's bytes per token, announced in every heartbeat (None: none to announce)."""
        self.connected = True
        self._seq = 0
        self._own: dict[int, _Own] = {}
        self._own_on: dict[str, dict[int, _Own]] = {}
        self._load = TokenLoadTracker()
        """Our own bookings' totals, as we publish them."""
        self._rows: dict[str, dict[int, bytes]] = {}
        """Per endpoint, our bookings' packed tail rows (those with a tail), kept as of each
        booking's last step or tick, so a send joins them instead of recounting every booking."""
        self._stale_rows: dict[int, None] = {}
        """Bookings with a tail that streamed since their row was packed (repacked at the tick,
        as their decode progress goes out)."""
        self._due: dict[str, None] = {}
        """Endpoints whose totals go out with the next :meth:`take_messages`."""
        self._dirty: dict[str, None] = {}
        """Endpoints whose totals changed since they last went out, due at the next :meth:`flush`."""
        self._prefix: dict[tuple[str, int, bytes], None] = {}
        self._peers: dict[str, _Peer] = {}
        self._next_peer_index = 0
        self._snapshots_wanted = False
        self._logged: set[str] = set()
        self._sharers: dict[Capability, frozenset[str]] = {}
        """Per capability, the live peers that announce it (cleared when peers or theirs change)."""

    # ---- outbound: this replica's own bookings -------------------------------------------

    def routed(
        self,
        key: int,
        endpoint: str,
        *,
        kv_tokens: int,
        uncached_tokens: int,
        expected_output: int,
        tpot_slo_ms: float | None = None,
        prompt_tail: int | None = None,
    ) -> None:
        """A request of ours was routed: ``kv_tokens`` prompt tokens, of which ``uncached_tokens``
        still to prefill, ``expected_output`` output tokens expected; its TPOT SLO if one runs;
        the hash of its prompt's last full block if the prefix index hashed it."""
        own = _Own(endpoint, tpot_slo_ms, prompt_tail)
        self._own[key] = own
        self._own_on.setdefault(endpoint, {})[key] = own
        self._load.admit(
            key, endpoint, kv_tokens, kv_tokens - min(uncached_tokens, kv_tokens), expected_output
        )
        self._pack_row(key, own)
        self._changed(endpoint, at_once=True)

    def prefix_inserted(self, endpoint: str, block_size: int, block_hashes: Sequence[int]) -> None:
        """We recorded these prompt blocks for ``endpoint`` in our approximate prefix index."""
        if block_hashes:
            self._wake_if_idle()
            # One RL step's rollouts insert the same prompt together: peers need it once.
            self._prefix[(endpoint, block_size, pack_hashes(block_hashes))] = None

    def first_token(self, key: int) -> None:
        own = self._own.get(key)
        if own is not None:
            self._load.first_token(key)
            self._pack_row(key, own)
            self._changed(own.endpoint, at_once=True)

    def progress(self, key: int, generated: int) -> None:
        """``generated`` output tokens so far; published at the next :meth:`flush`."""
        own = self._own.get(key)
        if own is not None:
            self._load.progress(key, generated)
            if own.prompt_tail is not None:
                self._stale_rows[key] = None
            self._changed(own.endpoint, at_once=False)

    def released(self, key: int) -> None:
        """The request is over, however it ended."""
        own = self._own.pop(key, None)
        if own is None:
            return
        self._load.finish(key)
        bookings = self._own_on[own.endpoint]
        del bookings[key]
        if not bookings:
            del self._own_on[own.endpoint]
        rows = self._rows.get(own.endpoint)
        if rows is not None and rows.pop(key, None) is not None and not rows:
            del self._rows[own.endpoint]
        self._stale_rows.pop(key, None)
        self._changed(own.endpoint, at_once=True)

    def _changed(self, endpoint: str, *, at_once: bool) -> None:
        """``endpoint``'s totals changed. A request routed, decoding or ended there goes out with
        the next :meth:`take_messages` (peers route on it; delaying it even to the next tick
        herds their picks in bursts: docs/benchmarks.md); decode progress waits for the tick."""
        if at_once:
            self._wake_if_idle()
            self._due[endpoint] = None
        else:
            self._dirty[endpoint] = None

    def flush(self) -> None:
        """The tick: queue the totals of every endpoint that changed since it last went out."""
        for key in self._stale_rows:
            self._pack_row(key, self._own[key])
        self._stale_rows.clear()
        if self._dirty:
            self._wake_if_idle()
            self._due.update(self._dirty)
            self._dirty.clear()

    def _pack_row(self, key: int, own: _Own) -> None:
        """Pack our booking ``key``'s tail row as it is now (``epp.load.peer_totals``), if it has a tail."""
        if own.prompt_tail is None:
            return
        row = self._load.booking_row(key)
        assert row is not None, "every booking in _own is in _load"
        self._rows.setdefault(own.endpoint, {})[key] = pack_tail_row((own.prompt_tail, *row))

    def _wake_if_idle(self) -> None:
        if not (self._due or self._prefix) and self.on_pending is not None:
            self.on_pending()

    def _totals(self, endpoint: str) -> list[Any]:
        """Our TOTALS for ``endpoint`` now, without the leading kind (see ``epp.sync.messages``)."""
        load = self._load.load(endpoint)
        bookings = self._own_on.get(endpoint, {})
        slos = [own.tpot_slo_ms for own in bookings.values() if own.tpot_slo_ms is not None]
        return [
            endpoint,
            load.requests,
            load.prefill_tokens,
            load.decode_tokens,
            load.expected_remaining_tokens,
            load.kv_tokens,
            min(slos, default=None),
            b"".join(self._rows.get(endpoint, {}).values()),
        ]

    def take_messages(self) -> list[bytes]:
        """The queued prefix inserts, then the due endpoints' totals as they are now, as DELTAS
        messages (split by size), numbered from here on.

        Whatever is taken is gone: a message the transport cannot send leaves a gap that peers
        notice and repair with a snapshot."""
        if not (self._due or self._prefix):
            return []
        deltas = [[DeltaKind.PREFIX, *insert] for insert in self._prefix]
        deltas += [[DeltaKind.TOTALS, *self._totals(endpoint)] for endpoint in self._due]
        for endpoint in self._due:
            self._dirty.pop(endpoint, None)
        self._prefix, self._due = {}, {}
        messages: list[bytes] = []
        chunk: list[list[Any]] = []
        size = 0
        for delta in deltas:
            delta_size = _DELTA_OVERHEAD_BYTES + len(delta[-1])
            if chunk and size + delta_size > self.tuning.max_message_bytes:
                messages.append(self._message(chunk))
                chunk, size = [], 0
            chunk.append(delta)
            size += delta_size
        messages.append(self._message(chunk))
        return messages

    def unsent(self, data: bytes) -> None:
        """The transport could not send ``data`` (one of ours): count its deltas as dropped."""
        self.stats.dropped["unsent"] += len(decode(data).body)

    def _message(self, deltas: list[list[Any]]) -> bytes:
        self._seq += 1
        for delta in deltas:
            self.stats.sent[delta_name(delta[0])] += 1
        return encode(
            SyncMessage(
                MessageKind.DELTAS, self.replica_id, self.incarnation, self._seq, self.wall_clock(), deltas
            )
        )

    def heartbeat(self) -> bytes:
        """A HEARTBEAT carrying our latest ``seq`` and our capabilities (send it after
        :meth:`take_messages`'s messages)."""
        ratio = self.bytes_per_token()
        body: list[Any] = [int(self.capabilities)] if ratio is None else [int(self.capabilities), ratio]
        return self._envelope(MessageKind.HEARTBEAT, body)

    def snapshot(self) -> bytes:
        """A SNAPSHOT of our totals on every endpoint where we have bookings, as of now (which
        covers our latest ``seq``), and of the most recent blocks of our approximate prefix index."""
        totals = [self._totals(endpoint) for endpoint in self._own_on]
        prefix = []
        if self.targets.prefix_blocks is not None:
            size = self.targets.prefix_block_size
            prefix = [
                [endpoint, size, pack_hashes(hashes)]
                for endpoint, hashes in self.targets.prefix_blocks(self.tuning.snapshot_prefix_blocks)
            ]
        return self._envelope(MessageKind.SNAPSHOT, [totals, prefix])

    def snapshot_request(self) -> bytes:
        """The payload with which to ask a peer for its snapshot."""
        return self._envelope(MessageKind.SNAPSHOT_REQUEST, [])

    def answer(self, request: bytes) -> bytes | None:
        """Our snapshot, in answer to a peer's :meth:`snapshot_request`; None if it is unreadable."""
        message = self._decode(request)
        if message is None:
            return None
        if message.kind != MessageKind.SNAPSHOT_REQUEST:
            self._refuse("malformed", f"a {message.kind.name} message sent as a snapshot request")
            return None
        self.stats.snapshots["served"] += 1
        return self.snapshot()

    def _envelope(self, kind: MessageKind, body: list[Any]) -> bytes:
        return encode(
            SyncMessage(kind, self.replica_id, self.incarnation, self._seq, self.wall_clock(), body)
        )

    # ---- inbound: peers' bookings ---------------------------------------------------------

    def receive(self, data: bytes) -> Received | None:
        """Apply a peer's DELTAS, HEARTBEAT or SNAPSHOT. None if refused or our own."""
        message = self._decode(data)
        if message is None:
            return None
        if message.replica == self.replica_id:
            if message.incarnation != self.incarnation:
                self._refuse(
                    "replica_id_conflict",
                    f"another replica also calls itself {self.replica_id!r}: give each a unique --replica-id",
                )
            return None
        if message.kind in (MessageKind.SNAPSHOT_REQUEST, MessageKind.SCRAPES):
            self._refuse("malformed", f"a {message.kind.name} message sent on the events subject")
            return None
        peer = self._peer_for(message)
        if peer is None:
            return None
        peer.last_heard = self.clock()
        if message.kind == MessageKind.DELTAS:
            self._on_deltas(peer, message)
        elif message.kind == MessageKind.HEARTBEAT:
            self._announced(peer, heartbeat_capabilities(message.body))
            peer.bytes_per_token = heartbeat_bytes_per_token(message.body)
            if peer.kept is None and message.seq > peer.last_seq:
                self._gap(peer)
        elif not self._install(peer, message):
            return None
        return Received(message.kind, message.replica, self.wall_clock() - message.sent_at)

    def _decode(self, data: bytes) -> SyncMessage | None:
        try:
            return decode(data)
        except SchemaError as exc:
            self._refuse(exc.reason, str(exc), key=f"{exc.reason}:{exc.version!r}")
            return None

    def _refuse(self, reason: str, why: str, *, key: str | None = None, count: int = 1) -> None:
        self.stats.dropped[reason] += count
        key = key or reason
        if key not in self._logged:
            self._logged.add(key)
            log.warning("sync: dropped %s; further ones are only counted", why)

    def _peer_for(self, message: SyncMessage) -> _Peer | None:
        peer = self._peers.get(message.replica)
        if peer is not None and message.incarnation != peer.incarnation:
            if message.incarnation < peer.incarnation:
                self.stats.dropped["stale_incarnation"] += 1
                return None
            log.info("sync: peer %s restarted; dropping what its last incarnation booked", peer.replica)
            self._drop(peer)
            peer = None
        if peer is None:
            peer = _Peer(message.replica, message.incarnation, self._next_peer_index, self.clock())
            self._next_peer_index += 1
            self._peers[message.replica] = peer
            self._sharers.clear()
            # We have seen this incarnation from its very first delta only if this is it.
            from_start = (message.kind == MessageKind.DELTAS and message.seq == 1) or (
                message.kind == MessageKind.HEARTBEAT and message.seq == 0
            )
            if not from_start and message.kind != MessageKind.SNAPSHOT:
                self._await_snapshot(peer)
        return peer

    def _on_deltas(self, peer: _Peer, message: SyncMessage) -> None:
        if message.seq <= peer.last_seq:
            self.stats.dropped["duplicate"] += len(message.body)
            return
        if peer.kept is None and message.seq > peer.last_seq + 1:
            self._gap(peer)
        if peer.kept is not None:
            if len(peer.kept) >= self.tuning.max_kept_messages:
                self.stats.dropped["kept_overflow"] += sum(len(m.body) for m in peer.kept)
                peer.kept.clear()
            peer.kept.append(message)
        self._apply(peer, message.body)
        peer.last_seq = message.seq

    def _gap(self, peer: _Peer) -> None:
        self.stats.gaps += 1
        log.info("sync: missed messages from %s; asking it for a snapshot", peer.replica)
        self._await_snapshot(peer)

    def _await_snapshot(self, peer: _Peer) -> None:
        if peer.kept is None:
            peer.kept = []
        peer.asked = False
        self._snapshots_wanted = True

    def _install(self, peer: _Peer, message: SyncMessage) -> bool:
        """Install a peer's snapshot (or ignore a stale one); False if it is malformed."""
        if message.seq < peer.last_seq and peer.kept is None:
            self.stats.snapshots["stale"] += 1
            return True
        if len(message.body) != 2 or not all(isinstance(part, list) for part in message.body):
            self._refuse("malformed", f"a snapshot from {peer.replica} that is not [totals, prefix]")
            return False
        totals, prefix = message.body
        kept = peer.kept or []
        self._clear(peer)
        for entry in totals:
            if (outcome := self._apply_totals(peer, entry)) is not None:
                self._refuse(outcome, f"totals in a snapshot from {peer.replica} ({outcome})")
        for entry in prefix:
            outcome = self._apply_prefix([DeltaKind.PREFIX, *entry] if isinstance(entry, list) else [])
            if outcome is not None:
                self._refuse(outcome, f"prefix blocks in a snapshot from {peer.replica} ({outcome})")
        peer.kept, peer.asked, peer.last_seq = None, False, message.seq
        self.stats.snapshots["installed"] += 1
        for kept_message in kept:
            if kept_message.seq <= peer.last_seq:
                self.stats.dropped["superseded"] += len(kept_message.body)
            else:
                self._on_deltas(peer, kept_message)
        return True

    def _apply(self, peer: _Peer, deltas: Sequence[Any]) -> None:
        for delta in deltas:
            name = delta_name(delta[0]) if isinstance(delta, list) and delta else "unknown"
            if name == "unknown":
                outcome: str | None = "malformed"
            elif name == "totals":
                outcome = self._apply_totals(peer, delta[1:])
            else:
                outcome = self._apply_prefix(delta)
            if outcome is None:
                self.stats.applied[name] += 1
            else:
                self._refuse(
                    outcome, f"a {name} delta from {peer.replica} ({outcome})", key=f"{outcome}:{name}"
                )

    def _apply_totals(self, peer: _Peer, entry: object) -> str | None:
        """Replace what we hold of ``peer`` on one endpoint with its published totals there
        (a TOTALS delta without its kind); the reason it was dropped, or None."""
        if not isinstance(entry, list) or len(entry) != 8:
            return "malformed"
        endpoint, requests, prefill, decode, remaining, kv, slo, packed = entry
        counts = (requests, prefill, decode, remaining, kv)
        if type(endpoint) is not str or type(packed) is not bytes or len(packed) % TAIL_ROW_BYTES:
            return "malformed"
        if not type(requests) is type(prefill) is type(decode) is type(remaining) is type(kv) is int:
            return "malformed"
        if min(counts) < 0 or not (slo is None or (isinstance(slo, int | float) and slo > 0)):
            return "malformed"
        before = peer.totals.pop(endpoint, None)
        if requests:
            peer.totals[endpoint] = counts
        if self.targets.token_load is not None:
            self.targets.token_load.replace(peer.index, endpoint, counts, packed)
        if self.targets.tpot_slos is not None:
            self._set_tpot_slo(peer, endpoint, None if slo is None or not requests else float(slo))
        if before is not None and (requests < before[0] or prefill < before[1]):
            self._peer_freed()
        if requests != (before[0] if before is not None else 0) and self.on_peer_requests is not None:
            self.on_peer_requests(endpoint)
        return None

    def _set_tpot_slo(self, peer: _Peer, endpoint: str, slo: float | None) -> None:
        running = self.targets.tpot_slos
        assert running is not None
        if slo is not None:
            running.setdefault(endpoint, {})[peer.slo_key] = slo
        elif (on_endpoint := running.get(endpoint)) is not None:
            on_endpoint.pop(peer.slo_key, None)

    def _peer_freed(self) -> None:
        if self.on_peer_freed is not None:
            self.on_peer_freed()

    def _apply_prefix(self, delta: list[Any]) -> str | None:
        if len(delta) != 4:
            return "malformed"
        _, endpoint, block_size, packed = delta
        if not isinstance(endpoint, str) or not isinstance(packed, bytes) or len(packed) % 8:
            return "malformed"
        if self.targets.record_prefix is None:
            return "unused"
        if block_size != self.targets.prefix_block_size:
            return "block_size"
        self.targets.record_prefix(endpoint, unpack_hashes(packed))
        return None

    def _clear(self, peer: _Peer) -> None:
        """Forget everything ``peer`` published."""
        if self.targets.token_load is not None:
            self.targets.token_load.clear(peer.index)
        if self.targets.tpot_slos is not None:
            for endpoint in peer.totals:
                self._set_tpot_slo(peer, endpoint, None)
        if peer.totals:
            peer.totals.clear()
            self._peer_freed()

    def _drop(self, peer: _Peer) -> None:
        self._clear(peer)
        del self._peers[peer.replica]
        self._sharers.clear()

    def _announced(self, peer: _Peer, capabilities: Capability) -> None:
        if capabilities != peer.capabilities:
            peer.capabilities = capabilities
            self._sharers.clear()

    # ---- peers' lives ---------------------------------------------------------------------

    def wanted_snapshots(self) -> list[str]:
        """Peers to ask for a snapshot now; each is returned once until answered or failed."""
        if not self._snapshots_wanted:
            return []
        self._snapshots_wanted = False
        wanted = [p.replica for p in self._peers.values() if p.kept is not None and not p.asked]
        for replica in wanted:
            self._peers[replica].asked = True
        self.stats.snapshots["requested"] += len(wanted)
        return wanted

    def snapshot_failed(self, replica: str) -> None:
        """The snapshot request to ``replica`` got no answer; it is wanted again."""
        self.stats.snapshots["failed"] += 1
        peer = self._peers.get(replica)
        if peer is not None and peer.kept is not None:
            peer.asked = False
            self._snapshots_wanted = True

    def expire(self) -> list[str]:
        """Drop peers silent for ``peer_timeout_s`` with all they booked (not while disconnected)."""
        if not self.connected:
            return []
        deadline = self.clock() - self.tuning.peer_timeout_s
        expired = [p for p in self._peers.values() if p.last_heard < deadline]
        for peer in expired:
            log.info(
                "sync: peer %s silent for %.1f s; dropping its bookings",
                peer.replica,
                self.tuning.peer_timeout_s,
            )
            self._drop(peer)
        self.stats.expired_peers += len(expired)
        return [p.replica for p in expired]

    def connection_lost(self) -> None:
        """The transport lost its connection: keep the last known remote state, expire no one."""
        self.connected = False

    def connection_restored(self) -> None:
        """Connected again: every peer gets a fresh timeout and is re-snapshotted."""
        self.connected = True
        now = self.clock()
        for peer in self._peers.values():
            peer.last_heard = now
            self._await_snapshot(peer)

    def agreed_bytes_per_token(self) -> float | None:
        """The estimate's ratio to route on, so that every replica's ids (and prefix blocks, which
        they share) agree: that of the first replica by name among us and the live peers that
        announce one. None when that is us, or when none announces one (we use our own)."""
        own = self.bytes_per_token()
        announced = [(p.replica, p.bytes_per_token) for p in self._peers.values() if p.bytes_per_token]
        if own is not None:
            announced.append((self.replica_id, own))
        if not announced:
            return None
        first, ratio = min(announced)
        return None if first == self.replica_id else ratio

    @property
    def peers(self) -> list[str]:
        """The peers heard from within their timeout."""
        return list(self._peers)

    @property
    def peer_count(self) -> int:
        """How many peers were heard from within their timeout."""
        return len(self._peers)

    def peers_with(self, capability: Capability) -> frozenset[str]:
        """The live peers whose latest heartbeat announced ``capability`` (kept until a peer
        comes, goes or announces otherwise: the scraper asks on every tick)."""
        found = self._sharers.get(capability)
        if found is None:
            found = self._sharers[capability] = frozenset(
                p.replica for p in self._peers.values() if capability in p.capabilities
            )
        return found

    def peer_requests(self, endpoint: str) -> int:
        """The requests the live peers last published as in flight on ``endpoint``."""
        return sum(counts[0] for p in self._peers.values() if (counts := p.totals.get(endpoint)))

    def peer_bookings(self, replica: str) -> int:
        """The requests ``replica`` last published as in flight, over every endpoint."""
        peer = self._peers.get(replica)
        return sum(counts[0] for counts in peer.totals.values()) if peer is not None else 0

    def own_bookings(self) -> int:
        return len(self._own)
