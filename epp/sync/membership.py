"""Who the peers are: their incarnations, liveness, awaited snapshots and what they announce.

* A peer is known from its first message. One heard from for the first time mid-stream (its
  first message is not its first ever) awaits a snapshot: that is how a replica that starts or
  restarts converges.
* A peer that starts a new incarnation (a restart under the same name) has its old incarnation
  dropped at once; a message from an older incarnation than the one known is refused.
* A peer silent for a timeout is dropped (:meth:`Membership.expire`). While the
  transport is disconnected nobody expires: routing goes on with the last known remote state.
  On reconnection every peer gets a fresh timeout and awaits a snapshot.
* Each awaited snapshot is handed out once to be requested (:meth:`Membership.wanted_snapshots`),
  again only if that request failed.

Dropping a peer calls ``forget`` with its index, which names that incarnation in the shared
structures (``epp.sync.peer_load``). :meth:`Membership.expire` is O(peers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from epp.sync.deltas import Heartbeat
from epp.sync.messages import Capability, MessageKind, SyncMessage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Peer:
    replica: str
    incarnation: int
    index: int
    """Names this incarnation in the shared structures' booking keys."""
    last_heard: float
    last_seq: int = 0
    kept: list[SyncMessage] | None = None
    """DELTAS messages kept for replay while a snapshot is awaited (None: in sync)."""
    asked: bool = False
    """The awaited snapshot was handed out to be requested."""
    capabilities: Capability = Capability.NONE
    """What its latest heartbeat announced (none until one came)."""
    bytes_per_token: float | None = None
    """The estimate's ratio its latest heartbeat announced (``epp.tokenizer.sampling``)."""


class Membership:
    def __init__(self, clock: Callable[[], float], forget: Callable[[int], None]) -> None:
        """``clock`` is monotonic seconds; ``forget(index)`` drops what a peer published."""
        self._clock = clock
        self._forget = forget
        self.connected = True
        self._peers: dict[str, Peer] = {}
        self._next_index = 0
        self._snapshots_wanted = False
        self._sharers: dict[Capability, frozenset[str]] = {}
        """Per capability, the live peers that announce it (cleared when peers or theirs change)."""

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def names(self) -> list[str]:
        return list(self._peers)

    def get(self, replica: str) -> Peer | None:
        return self._peers.get(replica)

    def peer_for(self, message: SyncMessage) -> Peer | None:
        """The sender of ``message``, heard from now (known from now on if it was not);
        None if it is from an older incarnation than the one known."""
        peer = self._peers.get(message.replica)
        if peer is not None and message.incarnation != peer.incarnation:
            if message.incarnation < peer.incarnation:
                return None
            log.info("sync: peer %s restarted; dropping what its last incarnation booked", peer.replica)
            self._drop(peer)
            peer = None
        if peer is None:
            peer = Peer(message.replica, message.incarnation, self._next_index, self._clock())
            self._next_index += 1
            self._peers[message.replica] = peer
            self._sharers.clear()
            # We have seen this incarnation from its very first delta only if this is it.
            from_start = (message.kind == MessageKind.DELTAS and message.seq == 1) or (
                message.kind == MessageKind.HEARTBEAT and message.seq == 0
            )
            if not from_start and message.kind != MessageKind.SNAPSHOT:
                self.await_snapshot(peer)
        peer.last_heard = self._clock()
        return peer

    def announced(self, peer: Peer, heartbeat: Heartbeat) -> None:
        if heartbeat.capabilities != peer.capabilities:
            peer.capabilities = heartbeat.capabilities
            self._sharers.clear()
        peer.bytes_per_token = heartbeat.bytes_per_token

    def gap(self, peer: Peer) -> None:
        """Messages from ``peer`` were lost: it awaits a snapshot."""
        log.info("sync: missed messages from %s; asking it for a snapshot", peer.replica)
        self.await_snapshot(peer)

    def await_snapshot(self, peer: Peer) -> None:
        if peer.kept is None:
            peer.kept = []
        peer.asked = False
        self._snapshots_wanted = True

    def snapshot_installed(self, peer: Peer, seq: int) -> list[SyncMessage]:
        """``peer``'s snapshot as of ``seq`` is in; the messages kept meanwhile, to replay."""
        kept = peer.kept or []
        peer.kept, peer.asked, peer.last_seq = None, False, seq
        return kept

    def wanted_snapshots(self) -> list[str]:
        """Peers to ask for a snapshot now; each is returned once until answered or failed."""
        if not self._snapshots_wanted:
            return []
        self._snapshots_wanted = False
        wanted = [p.replica for p in self._peers.values() if p.kept is not None and not p.asked]
        for replica in wanted:
            self._peers[replica].asked = True
        return wanted

    def snapshot_failed(self, replica: str) -> None:
        """The snapshot request to ``replica`` got no answer; it is wanted again."""
        peer = self._peers.get(replica)
        if peer is not None and peer.kept is not None:
            peer.asked = False
            self._snapshots_wanted = True

    def expire(self, peer_timeout_s: float) -> list[str]:
        """Drop the peers silent for ``peer_timeout_s`` (none while disconnected); their names."""
        if not self.connected:
            return []
        deadline = self._clock() - peer_timeout_s
        expired = [p for p in self._peers.values() if p.last_heard < deadline]
        for peer in expired:
            log.info("sync: peer %s silent for %.1f s; dropping its bookings", peer.replica, peer_timeout_s)
            self._drop(peer)
        return [p.replica for p in expired]

    def connection_lost(self) -> None:
        self.connected = False

    def connection_restored(self) -> None:
        self.connected = True
        now = self._clock()
        for peer in self._peers.values():
            peer.last_heard = now
            self.await_snapshot(peer)

    def peers_with(self, capability: Capability) -> frozenset[str]:
        """The live peers whose latest heartbeat announced ``capability`` (cached until a peer
        comes, goes or announces otherwise: the scraper asks on every tick)."""
        found = self._sharers.get(capability)
        if found is None:
            found = self._sharers[capability] = frozenset(
                p.replica for p in self._peers.values() if capability in p.capabilities
            )
        return found

    def bytes_per_token(self) -> list[tuple[str, float]]:
        """The live peers that announce an estimate's ratio, with it."""
        return [(p.replica, p.bytes_per_token) for p in self._peers.values() if p.bytes_per_token]

    def _drop(self, peer: Peer) -> None:
        self._forget(peer.index)
        del self._peers[peer.replica]
        self._sharers.clear()
