"""The pure apply layer of replica sync: no I/O, no threads, time from injected clocks.

One :class:`ReplicaSyncState` per EPP replica. It numbers what this replica publishes and
orders what its peers publish; the jobs themselves are done by:

``epp.sync.own_bookings``  this replica's bookings, their totals per endpoint, what is due out
``epp.sync.prefix_share``  the approximate prefix index's inserts, ours out and the peers' in
``epp.sync.peer_load``     the peers' published totals, applied where the local plugins read them
``epp.sync.membership``    the peers' incarnations, liveness, awaited snapshots and announcements
``epp.sync.deltas``        the typed deltas and message bodies (``epp.sync.messages``: the wire)

* **Outbound.** The replica's pipeline hook (``epp.sync.hook``) reports the lifecycle of every
  request this replica routes. For each endpoint whose totals changed, the totals themselves
  (absolute values, not the change) go out with the next :meth:`ReplicaSyncState.take_messages`
  when a request is routed, starts decoding or ends there, and at the next
  :meth:`ReplicaSyncState.flush` (the tick) for decode progress. However many requests change an
  endpoint between two takes, it goes out once, as it is at the take; the live transport takes
  at most every ``publish_interval_s``, so an endpoint goes out at most 1 / publish_interval_s
  + 1 / progress_interval_s times a second. Prefix inserts go out as they come. Messages are
  numbered per incarnation.
* **Inbound.** Messages from peers (:meth:`ReplicaSyncState.receive`) are applied to the
  structures the local plugins read (``SyncTargets``). Local decisions read whatever has
  arrived; nothing here waits. A replica's apply work is therefore bounded by endpoints × peers
  × take and tick rates, whatever the pool's request rate (``llm-epp-bench sync-apply``).

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
is O(peers), a prefix insert O(blocks); publishing an endpoint's totals is O(our bookings there);
dropping a peer and installing a snapshot O(endpoints + its prefix blocks) and answering one
O(our bookings + ``snapshot_prefix_blocks``).

Consistency rules (who the peers are, and when they are dropped: ``epp.sync.membership``):

* A peer's messages apply in ``seq`` order. A duplicate (``seq`` already applied) is dropped. A
  gap (a ``seq`` skipped, or a heartbeat announcing a ``seq`` never seen) means messages were
  lost: the state asks that peer for a snapshot (:meth:`ReplicaSyncState.wanted_snapshots`) and,
  until it comes, keeps applying what arrives (best effort) while also keeping it; the snapshot
  then replaces the bookings it knew of that peer (its prefix blocks are merged into the index,
  which does not tell whose insert a block was), and the kept messages numbered after the
  snapshot replay.
* Totals are absolute, so applying one twice, or one that a snapshot already includes, changes
  nothing.

Replicas of one pool are assumed to run the same EndpointPickerConfig: a structure missing
locally is skipped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from epp.load.peer_totals import PeerTotals
from epp.sync.deltas import Heartbeat, Snapshot
from epp.sync.membership import Membership, Peer
from epp.sync.messages import (
    Capability,
    DeltaKind,
    MessageKind,
    SchemaError,
    SyncMessage,
    decode,
    delta_name,
    encode,
)
from epp.sync.own_bookings import OwnBookings
from epp.sync.peer_load import PeerLoad
from epp.sync.prefix_share import PrefixShare, RecentBlocks, RecordPrefix

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
    smallest under its own key, ``epp.sync.peer_load``)."""
    record_prefix: RecordPrefix | None = None
    """Record that an endpoint was sent these prompt blocks (the approximate prefix index)."""
    prefix_block_size: int = 0
    prefix_blocks: RecentBlocks | None = None
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


class AppliesDeltas(Protocol):
    """Where one kind of delta from peers goes (``epp.sync.peer_load``, ``epp.sync.prefix_share``)."""

    def apply(self, peer: int, fields: object) -> str | None:
        """Apply a delta's ``fields`` (``epp.sync.deltas``) from the peer of this index; the
        reason it was dropped (``malformed`` if they are not of this kind's shape), or None."""
        ...


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
        self.bytes_per_token: Callable[[], float | None] = lambda: None
        """Our estimate's bytes per token, announced in every heartbeat (None: none to announce)."""
        self._seq = 0
        self._logged: set[str] = set()
        self._bookings = OwnBookings(self._wake_if_idle)
        self._prefix = PrefixShare(
            self._wake_if_idle,
            targets.record_prefix,
            targets.prefix_block_size,
            targets.prefix_blocks,
        )
        self._peer_load = PeerLoad(targets.token_load, targets.tpot_slos)
        self._membership = Membership(clock, self._peer_load.forget)
        # The lifecycle of our requests, as the pipeline hook reports it, goes straight to the part
        # that keeps it (bound here, not wrapped: these run for every request routed).
        self.routed = self._bookings.routed
        self.first_token = self._bookings.first_token
        self.progress = self._bookings.progress
        self.released = self._bookings.released
        self.flush = self._bookings.flush
        self.prefix_inserted = self._prefix.inserted
        self._appliers: dict[int, tuple[str, AppliesDeltas]] = {
            DeltaKind.TOTALS: ("totals", self._peer_load),
            DeltaKind.PREFIX: ("prefix", self._prefix),
        }
        """Per delta kind, its name (``epp.sync.messages.delta_name``) and where it goes."""

    @property
    def on_peer_freed(self) -> Callable[[], None] | None:
        """Called when a peer published fewer requests or less prefill on an endpoint than before
        (its load went down: flow control's wake-up)."""
        return self._peer_load.on_freed

    @on_peer_freed.setter
    def on_peer_freed(self, callback: Callable[[], None] | None) -> None:
        self._peer_load.on_freed = callback

    @property
    def on_peer_requests(self) -> Callable[[str], None] | None:
        """Called with an endpoint where a peer published another number of requests than before
        (it routed there or saw one end: the scraper's wake-up, as for this replica's own)."""
        return self._peer_load.on_requests

    @on_peer_requests.setter
    def on_peer_requests(self, callback: Callable[[str], None] | None) -> None:
        self._peer_load.on_requests = callback

    # ---- outbound: this replica's own bookings (epp.sync.own_bookings, epp.sync.prefix_share) ----

    def _wake_if_idle(self) -> None:
        if not (self._bookings.any_due or self._prefix.any_queued) and self.on_pending is not None:
            self.on_pending()

    def take_messages(self) -> list[bytes]:
        """The queued prefix inserts, then the due endpoints' totals as they are now, as DELTAS
        messages (split by size), numbered from here on.

        Whatever is taken is gone: a message the transport cannot send leaves a gap that peers
        notice and repair with a snapshot."""
        if not (self._bookings.any_due or self._prefix.any_queued):
            return []
        deltas = [insert.delta() for insert in self._prefix.take()]
        deltas += [totals.delta() for totals in self._bookings.take_due()]
        messages: list[bytes] = []
        chunk: list[list[Any]] = []
        size = 0
        for delta in deltas:
            delta_size = _DELTA_OVERHEAD_BYTES + len(delta[-1])  # its packed bytes come last
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
        return self._envelope(MessageKind.DELTAS, deltas)

    def heartbeat(self) -> bytes:
        """A HEARTBEAT carrying our latest ``seq`` and our capabilities (send it after
        :meth:`take_messages`'s messages)."""
        return self._envelope(
            MessageKind.HEARTBEAT, Heartbeat(self.capabilities, self.bytes_per_token()).body()
        )

    def snapshot(self) -> bytes:
        """A SNAPSHOT of our totals on every endpoint where we have bookings, as of now (which
        covers our latest ``seq``), and of the most recent blocks of our approximate prefix index."""
        return self._envelope(
            MessageKind.SNAPSHOT,
            Snapshot.body(
                self._bookings.all_totals(), self._prefix.recent(self.tuning.snapshot_prefix_blocks)
            ),
        )

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

    # ---- inbound: peers' messages, in order (epp.sync.peer_load, epp.sync.prefix_share) ---------

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
        peer = self._membership.peer_for(message)
        if peer is None:
            self.stats.dropped["stale_incarnation"] += 1
            return None
        if message.kind == MessageKind.DELTAS:
            self._on_deltas(peer, message)
        elif message.kind == MessageKind.HEARTBEAT:
            self._membership.announced(peer, Heartbeat.read(message.body))
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

    def _refuse(self, reason: str, why: str, *, key: str | None = None) -> None:
        self.stats.dropped[reason] += 1
        key = key or reason
        if key not in self._logged:
            self._logged.add(key)
            log.warning("sync: dropped %s; further ones are only counted", why)

    def _on_deltas(self, peer: Peer, message: SyncMessage) -> None:
        if message.seq <= peer.last_seq:
            self.stats.dropped["duplicate"] += len(message.body)
            return
        if peer.kept is None and message.seq > peer.last_seq + 1:
            self._gap(peer)
        if peer.kept is not None:  # awaiting a snapshot: keep it to replay after
            if len(peer.kept) >= self.tuning.max_kept_messages:
                self.stats.dropped["kept_overflow"] += sum(len(m.body) for m in peer.kept)
                peer.kept.clear()
            peer.kept.append(message)
        self._apply(peer, message.body)
        peer.last_seq = message.seq

    def _gap(self, peer: Peer) -> None:
        self.stats.gaps += 1
        self._membership.gap(peer)

    def _install(self, peer: Peer, message: SyncMessage) -> bool:
        """Install a peer's snapshot (or ignore a stale one); False if it is malformed."""
        if message.seq < peer.last_seq and peer.kept is None:
            self.stats.snapshots["stale"] += 1
            return True
        snapshot = Snapshot.read(message.body)
        if snapshot is None:
            self._refuse("malformed", f"a snapshot from {peer.replica} that is not [totals, prefix]")
            return False
        self._peer_load.forget(peer.index)
        for kind, what, entries in (
            (DeltaKind.TOTALS, "totals", snapshot.totals),
            (DeltaKind.PREFIX, "prefix blocks", snapshot.prefix),
        ):
            _, applier = self._appliers[kind]
            for entry in entries:
                if (outcome := applier.apply(peer.index, entry)) is not None:
                    self._refuse(outcome, f"{what} in a snapshot from {peer.replica} ({outcome})")
        kept = self._membership.snapshot_installed(peer, message.seq)
        self.stats.snapshots["installed"] += 1
        for kept_message in kept:
            if kept_message.seq <= peer.last_seq:
                self.stats.dropped["superseded"] += len(kept_message.body)
            else:
                self._on_deltas(peer, kept_message)
        return True

    def _apply(self, peer: Peer, deltas: Sequence[Any]) -> None:
        applied: list[str] = []
        for delta in deltas:
            kind = delta[0] if isinstance(delta, list) and delta else None
            # Only an int can be a kind (and a list would not hash).
            known = self._appliers.get(kind) if type(kind) is int else None
            if known is None:
                name, outcome = "unknown", "malformed"
            else:
                name, applier = known
                outcome = applier.apply(peer.index, delta[1:])
            if outcome is None:
                applied.append(name)
            else:
                self._refuse(
                    outcome, f"a {name} delta from {peer.replica} ({outcome})", key=f"{outcome}:{name}"
                )
        # Counted once a message: a Counter increment per delta was a twentieth of applying one.
        self.stats.applied.update(applied)

    # ---- peers' lives (epp.sync.membership) -----------------------------------------------------

    def wanted_snapshots(self) -> list[str]:
        """Peers to ask for a snapshot now; each is returned once until answered or failed."""
        wanted = self._membership.wanted_snapshots()
        self.stats.snapshots["requested"] += len(wanted)
        return wanted

    def snapshot_failed(self, replica: str) -> None:
        """The snapshot request to ``replica`` got no answer; it is wanted again."""
        self.stats.snapshots["failed"] += 1
        self._membership.snapshot_failed(replica)

    def expire(self) -> list[str]:
        """Drop peers silent for ``peer_timeout_s`` with all they booked (not while disconnected)."""
        expired = self._membership.expire(self.tuning.peer_timeout_s)
        self.stats.expired_peers += len(expired)
        return expired

    def connection_lost(self) -> None:
        """The transport lost its connection: keep the last known remote state, expire no one."""
        self._membership.connection_lost()

    def connection_restored(self) -> None:
        """Connected again: every peer gets a fresh timeout and is re-snapshotted."""
        self._membership.connection_restored()

    def agreed_bytes_per_token(self) -> float | None:
        """The estimate's ratio to route on, so that every replica's ids (and prefix blocks, which
        they share) agree: that of the first replica by name among us and the live peers that
        announce one. None when that is us, or when none announces one (we use our own)."""
        own = self.bytes_per_token()
        announced = self._membership.bytes_per_token()
        if own is not None:
            announced.append((self.replica_id, own))
        if not announced:
            return None
        first, ratio = min(announced)
        return None if first == self.replica_id else ratio

    @property
    def peers(self) -> list[str]:
        """The peers heard from within their timeout."""
        return self._membership.names

    @property
    def peer_count(self) -> int:
        """How many peers were heard from within their timeout."""
        return len(self._membership)

    def peers_with(self, capability: Capability) -> frozenset[str]:
        """The live peers whose latest heartbeat announced ``capability``."""
        return self._membership.peers_with(capability)

    def peer_requests(self, endpoint: str) -> int:
        """The requests the live peers last published as in flight on ``endpoint``."""
        return self._peer_load.requests_on(endpoint)

    def peer_bookings(self, replica: str) -> int:
        """The requests ``replica`` last published as in flight, over every endpoint."""
        peer = self._membership.get(replica)
        return self._peer_load.requests_of(peer.index) if peer is not None else 0

    def own_bookings(self) -> int:
        return len(self._bookings)
