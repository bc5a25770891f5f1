"""This replica's own bookings, as its peers see them: per endpoint, totals that go out when they change.

The pipeline hook (``epp.sync.hook``) reports the lifecycle of every request this replica routes
(routed, first token, decode progress, released). :class:`OwnBookings` keeps their totals per
endpoint and marks an endpoint due when they change: at once when a request is routed, starts
decoding or ends there (peers route on it; delaying it even to the next tick herds their picks
in bursts: docs/benchmarks.md), at the next :meth:`OwnBookings.flush` (the sync tick) for decode
progress. :meth:`OwnBookings.take_due` hands out each due endpoint's :class:`~epp.sync.deltas.Totals`
once, as it is at the take, however many requests changed it since the last take.

Publishing an endpoint's totals is O(our bookings there): the bookings that name their prompt's
tail keep their packed tail row (``epp.load.peer_totals``) as of their last step or tick, so a
take joins rows instead of recounting every booking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from epp.load.peer_totals import pack_tail_row
from epp.load.token_load import TokenLoadTracker
from epp.sync.deltas import Totals


class _Own(NamedTuple):
    endpoint: str
    tpot_slo_ms: float | None
    prompt_tail: int | None


class OwnBookings:
    def __init__(self, wake: Callable[[], None]) -> None:
        """``wake`` is called before an endpoint becomes due at once (the outbox's wake-up: it
        checks itself whether the outbox was empty)."""
        self._wake = wake
        self._own: dict[int, _Own] = {}
        self._own_on: dict[str, dict[int, _Own]] = {}
        self._load = TokenLoadTracker()
        """Our own bookings' totals, as we publish them."""
        self._rows: dict[str, dict[int, bytes]] = {}
        """Per endpoint, our bookings' packed tail rows (those with a tail)."""
        self._stale_rows: dict[int, None] = {}
        """Bookings with a tail that streamed since their row was packed (repacked at the tick,
        as their decode progress goes out)."""
        self._due: dict[str, None] = {}
        """Endpoints whose totals go out with the next take."""
        self._dirty: dict[str, None] = {}
        """Endpoints whose totals changed since they last went out, due at the next :meth:`flush`."""

    def __len__(self) -> int:
        """Our requests in flight."""
        return len(self._own)

    @property
    def any_due(self) -> bool:
        return bool(self._due)

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
        self._due_now(endpoint)

    def first_token(self, key: int) -> None:
        """The request streams its first token."""
        own = self._own.get(key)
        if own is not None:
            self._load.first_token(key)
            self._pack_row(key, own)
            self._due_now(own.endpoint)

    def progress(self, key: int, generated: int) -> None:
        """``generated`` output tokens so far; due at the next :meth:`flush`."""
        own = self._own.get(key)
        if own is not None:
            self._load.progress(key, generated)
            if own.prompt_tail is not None:
                self._stale_rows[key] = None
            self._dirty[own.endpoint] = None

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
        self._due_now(own.endpoint)

    def flush(self) -> None:
        """The tick: every endpoint that changed since it last went out is due."""
        for key in self._stale_rows:
            self._pack_row(key, self._own[key])
        self._stale_rows.clear()
        if self._dirty:
            self._wake()
            self._due.update(self._dirty)
            self._dirty.clear()

    def take_due(self) -> list[Totals]:
        """The due endpoints' totals as they are now; none is due after."""
        taken = [self.totals(endpoint) for endpoint in self._due]
        for endpoint in self._due:
            self._dirty.pop(endpoint, None)
        self._due = {}
        return taken

    def all_totals(self) -> list[Totals]:
        """Our totals on every endpoint where we have bookings (a snapshot's)."""
        return [self.totals(endpoint) for endpoint in self._own_on]

    def totals(self, endpoint: str) -> Totals:
        load = self._load.load(endpoint)
        bookings = self._own_on.get(endpoint, {})
        slos = [own.tpot_slo_ms for own in bookings.values() if own.tpot_slo_ms is not None]
        return Totals(
            endpoint,
            load.requests,
            load.prefill_tokens,
            load.decode_tokens,
            load.expected_remaining_tokens,
            load.kv_tokens,
            min(slos, default=None),
            b"".join(self._rows.get(endpoint, {}).values()),
        )

    def _due_now(self, endpoint: str) -> None:
        self._wake()
        self._due[endpoint] = None

    def _pack_row(self, key: int, own: _Own) -> None:
        """Pack booking ``key``'s tail row as it is now, if it has a tail."""
        if own.prompt_tail is None:
            return
        row = self._load.booking_row(key)
        assert row is not None, "every booking in _own is in _load"
        self._rows.setdefault(own.endpoint, {})[key] = pack_tail_row((own.prompt_tail, *row))
