"""Streams metered to the first token only, finished from the gateway's access log.

With ``--response-metering first-token`` the EPP answers a streamed response's chunks until the
first output token, then ends its ext_proc stream: Envoy re-injects the chunks it queued and
carries on without the EPP, so a 500-token answer costs the EPP what a 1-token one does. The
request is then *handed off*: still booked (token load, in-flight count), and finished when
Envoy's access log for it arrives (:class:`LogEntry`, from ``epp.extproc.access_log``).

What the log cannot say is made up as follows:

* **Output tokens**: from the response's body bytes, by a bytes-per-token line
  (:class:`BytesPerToken`) learned from the streams that are still metered chunk by chunk: the
  first ``calibration_streams`` of each kind of answer (model and API), then one stream in
  ``sample_every`` (:class:`MeteringPlan`). No estimate (None) before a kind has one.
* **The finish time** on the EPP's clock: Envoy's times count from the request's start, which
  is when the EPP received its headers give or take a hop (well under a millisecond), so the
  last upstream byte came at ``received_at + time_to_last_upstream_rx_byte``.
* **Decode progress**: estimated from the time since the first token and the endpoint's recent
  TPOT (:class:`DecodeRates`, from the requests it finished), at each
  :meth:`~epp.requestcontrol.director.Director.estimate_progress`; and Envoy logs long streams
  periodically (``access_log_flush_interval``), each such intermediate entry giving the bytes,
  hence the tokens, so far.
* **The first token of a request routed over ext_authz**, which the EPP never sees answered:
  from the gateway's mark in its log entries; until one comes, estimated at the endpoint's recent
  time to first token (:class:`EndpointMeans`, from the logged ones; at once without any), so
  that its prompt leaves the endpoint's prefill load. The logged time replaces the estimate in
  what the request's outcome reports.
* **A log entry that never comes** (the EPP restarted, the log stream broke): a handed-off
  request not heard of (first token, or an intermediate entry) for ``silence_s`` is finished
  as not completed (:meth:`HandOffs.expired`). Envoy's periodic entries keep a long stream
  alive, so ``silence_s`` must exceed the flush interval: the bound on a leaked booking.

Pure: no I/O, times are the caller's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

ResponseMetering = Literal["full", "first-token"]
"""Whether streamed responses are read to their end, or to their first token only."""
Ending = Literal["complete", "client_gone", "upstream_reset", "failed"]
"""How a request's exchange ended, as the gateway logged it."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LogEntry:
    """What the gateway's access log says of one request (times from the request's start)."""

    request_id: str
    status: int
    """The response's status (0 when none was sent)."""
    response_bytes: int
    """Body bytes sent to the client so far."""
    last_upstream_byte_s: float | None
    """When the engine's last response byte (so far) arrived; None if none did."""
    ended: Ending
    served_by: str | None = None
    """The ``ip:port`` that answered, after any retries."""
    intermediate: bool = False
    """A periodic entry for a stream still open: progress, not the end."""
    sse_events: int | None = None
    """A streamed answer's JSON events, if the gateway counted them (at its end)."""
    first_body_byte_s: float | None = None
    """When a streamed answer's first body byte (its first token) reached the gateway, if the
    gateway marked it: what a request routed over ext_authz, which the EPP never sees answered,
    has for a first token."""

    @property
    def completed(self) -> bool:
        return self.ended == "complete" and 200 <= self.status < 400


@dataclass(frozen=True, slots=True)
class MeteringSettings:
    """How streamed responses are metered (``--response-metering`` and its companions)."""

    mode: ResponseMetering = "full"
    sample_every: int = 1000
    """In first-token mode, one stream in this many is still metered chunk by chunk."""
    calibration_streams: int = 4
    """Each kind of answer's first streams are metered fully, whatever the sampling."""
    silence_s: float = 30.0
    """A handed-off request not heard of this long is finished as not completed."""


class BytesPerToken:
    """Each kind of answer's streamed size against its output tokens, from fully metered
    streams: a least-squares line ``bytes = overhead + per_token * tokens``. Each SSE event of a
    token is about the same size; a stream's first and last events (the role, the finish
    reason, ``[DONE]``, any usage) are its overhead, which a plain ratio would spread over the
    tokens and so overcount short answers. With streams of one length only, the plain ratio."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}
        """Per kind: streams, Σ tokens, Σ bytes, Σ tokens², Σ tokens × bytes."""

    def observe(self, kind: str, body_bytes: int, tokens: int) -> None:
        if tokens <= 0 or body_bytes <= 0:
            return
        sums = self._sums.setdefault(kind, [0.0] * 5)
        for i, value in enumerate((1, tokens, body_bytes, tokens * tokens, tokens * body_bytes)):
            sums[i] += value

    def line(self, kind: str) -> tuple[float, float] | None:
        """``(overhead, per_token)`` bytes for ``kind``, or None before any of its streams."""
        sums = self._sums.get(kind)
        if sums is None:
            return None
        n, t, b, tt, tb = sums
        spread = n * tt - t * t
        if spread > 1e-9 * max(1.0, n * tt):
            per_token = (n * tb - t * b) / spread
            overhead = (b - per_token * t) / n
            if per_token > 0 and overhead >= 0:
                return overhead, per_token
        return 0.0, b / t

    def tokens(self, kind: str, body_bytes: int) -> int | None:
        """The tokens ``body_bytes`` of a ``kind`` stream carry (at least 1), or None before any
        of its streams was metered."""
        line = self.line(kind)
        if line is None:
            return None
        overhead, per_token = line
        return max(1, round((body_bytes - overhead) / per_token))


class EndpointMeans:
    """Each endpoint's recent value of something: an exponentially weighted mean of what its
    finished requests showed (``weight`` for the newest); positive values only."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self._means: dict[str, float] = {}

    def observe(self, endpoint: str, value: float) -> None:
        if value <= 0:
            return
        last = self._means.get(endpoint)
        self._means[endpoint] = value if last is None else last + self.weight * (value - last)

    def mean(self, endpoint: str) -> float | None:
        return self._means.get(endpoint)


class DecodeRates(EndpointMeans):
    """Each endpoint's recent time per output token (TPOT) of the streamed requests it finished."""

    def tokens(self, endpoint: str, decoding_s: float, cap: int | None) -> int | None:
        """Tokens streamed ``decoding_s`` after the first (at most ``cap``), or None while the
        endpoint has no TPOT yet."""
        tpot = self.mean(endpoint)
        if tpot is None:
            return None
        tokens = 1 + int(max(0.0, decoding_s) / tpot)
        return tokens if cap is None else min(tokens, cap)


class MeteringPlan:
    """Which streams are metered chunk by chunk: each kind's first ``calibration_streams``,
    then every ``sample_every``-th (deterministic, so a test or a replay sees the same)."""

    def __init__(self, settings: MeteringSettings) -> None:
        self.settings = settings
        self._streams: dict[str, int] = {}

    def meter_fully(self, kind: str) -> bool:
        if self.settings.mode == "full":
            return True
        n = self._streams.get(kind, 0)
        self._streams[kind] = n + 1
        return n < self.settings.calibration_streams or n % self.settings.sample_every == 0


@dataclass(slots=True)
class _HandOff(Generic[T]):
    item: T
    heard_at: float


@dataclass(slots=True)
class HandOffs(Generic[T]):
    """Requests handed off to the access log, by request id, each with when it was last heard of.

    Ids of handed-off requests are unique while they wait (the director gives a request whose
    client reuses a live id a new one); an entry for an unknown id belongs to a request metered
    to its end, or to another replica, or to a request of the caller's not handed off yet: a
    short answer's entry can reach the EPP before its own stream's end does (under load, by more
    than the log's 0.1 s flush). The caller keeps such an entry here (``keep_early``, at most
    one per live request of its own); the request's hand-off takes it back."""

    silence_s: float
    _waiting: dict[Hashable, _HandOff[T]] = field(default_factory=dict)
    _early: dict[Hashable, LogEntry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._waiting

    def add(self, request_id: Hashable, item: T, now: float) -> LogEntry | None:
        """Hand the request off; the final entry that came for it before, if one did."""
        self._waiting[request_id] = _HandOff(item, now)
        return self._early.pop(request_id, None)

    def keep_early(self, entry: LogEntry) -> None:
        """The final entry of a live request not handed off yet, for its hand-off."""
        self._early[entry.request_id] = entry

    def drop_early(self, request_id: Hashable) -> LogEntry | None:
        """The request ended without a hand-off: its early entry, if one came, is no longer
        kept (and is returned)."""
        return self._early.pop(request_id, None)

    def heard(self, request_id: Hashable, now: float) -> T | None:
        """An intermediate entry: the request is still streaming. Its item, or None if unknown."""
        waiting = self._waiting.get(request_id)
        if waiting is None:
            return None
        waiting.heard_at = max(waiting.heard_at, now)
        return waiting.item

    def pop(self, request_id: Hashable) -> T | None:
        """The final entry: the request is no longer waiting. Its item, or None if unknown."""
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else waiting.item

    def waiting(self) -> Iterator[T]:
        """Every request still waiting (do not add or take out while iterating)."""
        return (w.item for w in self._waiting.values())

    def expired(self, now: float) -> Iterator[T]:
        """Take out and yield the requests not heard of for ``silence_s``."""
        late = [k for k, w in self._waiting.items() if now - w.heard_at >= self.silence_s]
        for key in late:
            yield self._waiting.pop(key).item


def finish_time(received_at: float, first_token_at: float | None, entry: LogEntry, now: float) -> float:
    """When the request ended on the EPP's clock: its last upstream byte, placed from the moment
    the EPP received its headers, kept between its first token and ``now``."""
    if entry.last_upstream_byte_s is None:
        return now
    at = received_at + entry.last_upstream_byte_s
    if first_token_at is not None:
        at = max(at, first_token_at)
    return min(at, now)
