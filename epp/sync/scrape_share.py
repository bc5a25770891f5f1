"""Scrape sharing among synced replicas: each endpoint is scraped by one of them, which
publishes what it read, and the others apply it as if they had scraped it themselves.

The pure layer (no I/O, time from the injected clock); :class:`~epp.datalayer.scraper.MetricsScraper`
asks it what to do on each tick of each endpoint and tells it what it scraped, and the NATS
transport (``epp.sync.nats_transport``) carries its messages on their own subject.

* **Owners.** The replicas that share scrapes are this one and its live peers whose heartbeat
  announces :attr:`~epp.sync.messages.Capability.SHARES_SCRAPES` (a peer of an older version
  announces nothing, so it owns nothing and scrapes everything itself, as before). Each endpoint's
  owner among them is chosen by rendezvous hashing (``epp.sync.scrape_owners``). Replicas may
  disagree for a heartbeat or so while one joins or leaves; the staleness rule below covers that.
* **Outbound.** After each scrape of an endpoint it owns the scraper hands the result here
  (:meth:`ScrapeShare.scraped`): the figures, or why the endpoint left scheduling. The latest one
  per endpoint waits in the outbox; :meth:`ScrapeShare.take_message` packs them all into one
  SCRAPES message (``epp.sync.messages``), each with its age and the owner's period until its
  next scrape. The transport takes at most once per fast tick, so peers apply at most
  endpoints / tick figures a second whatever K is.
* **Inbound.** :meth:`ScrapeShare.receive` applies a peer's figures to the
  :class:`~epp.datalayer.endpoints.EndpointStore` exactly as a local scrape would
  (``record_scrape`` stamped ``now - age``, which is also a sign of life), or the failure
  (``record_failure``), and keeps, per endpoint, until when that view is *fresh*: the scrape's
  time plus the owner's period plus ``stale_after_s``. A figure older than the one held (a
  fallback scrape of our own may be newer) is not applied, but still makes the view fresh.
* **Skip or scrape** (:meth:`ScrapeShare.shared_until`): the scraper skips an endpoint it does
  not own while its shared view is fresh, and scrapes it itself otherwise: the owner died, is
  cut off, NATS is down, the owners are being re-chosen, or the owner's scrape of a busy engine
  is late. Such a *fallback* scrape is counted and not published. ``stale_after_s``
  (:data:`STALE_AFTER_TICKS`, 3 fast ticks: 150 ms in the EPP) covers the owner's batching (at
  most one tick), the scrape's own time (a busy vLLM answers ``/metrics`` in milliseconds, late
  under heavy load) and the network (under a millisecond in a zone), with a tick to spare, so a
  live owner is never second-guessed on the fast tick; an engine that stalls is out of a
  non-owner's scheduling within the scraper's bound plus ``stale_after_s``
  (``epp.datalayer.scraper``).
* **Busy.** The owner keeps an endpoint on the fast tick while any peer has requests there
  (:meth:`ScrapeShare.peer_busy`), and a peer routing or ending one there wakes its poller as
  this replica's own would (``ReplicaSyncState.on_peer_requests``).

Context lengths (``/v1/models``, read once a minute) are not shared: each replica reads its own.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epp.datalayer.endpoints import EndpointStore
from epp.scheduling.types import EngineMetrics
from epp.sync.messages import Capability, MessageKind, SchemaError, SyncMessage, decode, encode
from epp.sync.scrape_owners import ScrapeOwners
from epp.sync.state import ReplicaSyncState

log = logging.getLogger(__name__)
ScrapeResult = EngineMetrics | str
"""A scrape's figures, or why it failed."""
STALE_AFTER_TICKS = 3
"""``stale_after_s`` in fast scrape ticks (see the module)."""


@dataclass(slots=True)
class ScrapeShareStats:
    """Counts for metrics (``epp.sync.metrics``)."""

    published: int = 0
    """Endpoint results handed to the transport."""
    applied: int = 0
    """Peers' endpoint results applied to the store."""
    fallback: int = 0
    """Scrapes of endpoints another replica owns, whose shared view was not fresh."""
    dropped: Counter[str] = field(default_factory=Counter)
    """By reason: malformed, version (a message refused whole counts once), unknown (an endpoint
    not in the pool here), older (than the figures held), unsent (ours, not sent)."""


@dataclass(frozen=True, slots=True)
class _Queued:
    result: ScrapeResult
    at: float
    period_s: float


class ScrapeShare:
    def __init__(
        self,
        state: ReplicaSyncState,
        store: EndpointStore,
        *,
        clock: Callable[[], float],
        stale_after_s: float,
    ) -> None:
        """``state`` is this replica's sync state (its peers, their capabilities and bookings;
        made with ``Capability.SHARES_SCRAPES``); ``clock`` the scraper's."""
        self.state = state
        self.store = store
        self.clock = clock
        self.stale_after_s = stale_after_s
        self.stats = ScrapeShareStats()
        self.on_pending: Callable[[], None] | None = None
        """Called when the outbox goes from empty to not empty (the transport's wake-up)."""
        self._owners = ScrapeOwners()
        self._outbox: dict[str, _Queued] = {}
        self._fresh_until: dict[str, float] = {}
        self._logged: set[str] = set()

    # ---- ownership ------------------------------------------------------------------------

    def owner(self, endpoint: str) -> str:
        """The replica that scrapes ``endpoint``, as far as this replica knows."""
        me = self.state.replica_id
        sharers = self.state.peers_with(Capability.SHARES_SCRAPES)
        return self._owners.owner(endpoint, sharers | {me}) if sharers else me

    @property
    def sharing(self) -> bool:
        """Whether a live peer shares scrapes (alone, this replica publishes nothing)."""
        return bool(self.state.peers_with(Capability.SHARES_SCRAPES))

    def owns(self, endpoint: str) -> bool:
        return self.owner(endpoint) == self.state.replica_id

    def shared_until(self, endpoint: str, now: float) -> float:
        """Until when this replica need not scrape ``endpoint`` (a time before ``now``: scrape it
        now). A scrape of an endpoint another replica owns, due now, counts as a fallback."""
        if self.owns(endpoint):
            return -math.inf
        until = self._fresh_until.get(endpoint, -math.inf)
        if until <= now:
            self.stats.fallback += 1
        return until

    def peer_busy(self, endpoint: str) -> bool:
        """Whether a live peer has requests in flight on ``endpoint``."""
        return self.state.peer_requests(endpoint) > 0

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool."""
        self._outbox.pop(endpoint, None)
        self._fresh_until.pop(endpoint, None)
        self._owners.forget(endpoint)

    # ---- outbound -------------------------------------------------------------------------

    def scraped(self, endpoint: str, result: ScrapeResult, period_s: float) -> None:
        """This replica scraped ``endpoint`` (its figures, or why it is out of scheduling) and
        will scrape it again in ``period_s``: published with the next take if it owns it and a
        peer shares scrapes."""
        if not self.sharing or not self.owns(endpoint):
            return
        if not self._outbox and self.on_pending is not None:
            self.on_pending()
        at = result.updated_at if isinstance(result, EngineMetrics) else self.clock()
        self._outbox[endpoint] = _Queued(result, at, period_s)

    def take_message(self) -> bytes | None:
        """The outbox as one SCRAPES message, ages as of now (None: nothing to send)."""
        if not self._outbox:
            return None
        now = self.clock()
        entries = [
            [endpoint, max(0.0, now - q.at), q.period_s, _pack_result(q.result)]
            for endpoint, q in self._outbox.items()
        ]
        self.stats.published += len(entries)
        self._outbox = {}
        s = self.state
        return encode(
            SyncMessage(MessageKind.SCRAPES, s.replica_id, s.incarnation, 0, s.wall_clock(), entries)
        )

    def unsent(self, data: bytes) -> None:
        """The transport could not send ``data`` (ours): count its results as dropped."""
        self.stats.dropped["unsent"] += len(decode(data).body)

    # ---- inbound --------------------------------------------------------------------------

    def receive(self, data: bytes) -> int:
        """Apply a peer's SCRAPES message; how many of its results were applied."""
        try:
            message = decode(data)
        except SchemaError as exc:
            self._refuse(exc.reason, str(exc))
            return 0
        if message.kind != MessageKind.SCRAPES:
            self._refuse("malformed", f"a {message.kind.name} message on the scrapes subject")
            return 0
        if message.replica == self.state.replica_id:
            return 0
        now = self.clock()
        applied = 0
        for entry in message.body:
            outcome = self._apply(entry, now)
            if outcome is None:
                applied += 1
            else:
                self._refuse(outcome, f"a scrape from {message.replica} ({outcome})")
        self.stats.applied += applied
        return applied

    def _apply(self, entry: object, now: float) -> str | None:
        """Apply one ``[endpoint, age_s, period_s, result]``; why it was dropped, or None."""
        if not isinstance(entry, list) or len(entry) != 4:
            return "malformed"
        endpoint, age, period, packed = entry
        if type(endpoint) is not str or not _seconds(age) or not _seconds(period):
            return "malformed"
        result = _unpack_result(packed)
        if result is None:
            return "malformed"
        state = self.store.by_name(endpoint)
        if state is None:
            return "unknown"
        at = now - age
        # The owner scrapes on: its view is fresh again, even when a fallback scrape of ours came
        # after this one (else the next fallback would again be newer than the owner's next
        # figures, and this replica would keep scraping what the owner scrapes).
        until = at + period + self.stale_after_s
        self._fresh_until[endpoint] = max(until, self._fresh_until.get(endpoint, -math.inf))
        if at < state.metrics.updated_at:
            return "older"
        if isinstance(result, str):
            if self.store.is_healthy(endpoint):
                log.warning("endpoint %s unhealthy (scraped by a peer): %s", endpoint, result)
            self.store.record_failure(endpoint, result)
        else:
            self.store.record_scrape(endpoint, EngineMetrics(*result, updated_at=at))
        return None

    def _refuse(self, reason: str, why: str) -> None:
        self.stats.dropped[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("sync: dropped %s; further ones are only counted", why)


def _seconds(value: object) -> bool:
    """A finite number of seconds, not negative."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf


def _pack_result(result: ScrapeResult) -> list[Any] | str:
    if isinstance(result, str):
        return result
    m = result
    return [m.waiting, m.running, m.kv_cache_usage, m.block_size, m.num_gpu_blocks]


def _unpack_result(packed: object) -> tuple[int, int, float, int | None, int | None] | str | None:
    """The figures (without their time) or failure reason of a packed result; None if malformed
    (of the wrong types, or a KV usage outside [0, 1], which the scraper's parser never gives)."""
    if type(packed) is str:
        return packed
    if not isinstance(packed, list) or len(packed) != 5:
        return None
    waiting, running, kv, block_size, gpu_blocks = packed
    if type(waiting) is not int or type(running) is not int:
        return None
    if type(kv) not in (int, float) or not 0 <= kv <= 1:
        return None
    if not all(v is None or type(v) is int for v in (block_size, gpu_blocks)):
        return None
    return waiting, running, float(kv), block_size, gpu_blocks
