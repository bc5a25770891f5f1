"""Token load per endpoint: work routed there and not yet done, updated at each lifecycle step.

Request counts are a poor load signal when prompts and outputs vary by 1000×. What an engine
still has to do for the requests the EPP sent it is (a) the prompt tokens it has not yet
prefilled — the uncached part of each prompt, until the first token comes back — and (b) the
KV tokens of requests that are decoding, which grow with every generated token and bound
how fast the batch decodes. Both are known the moment a request is routed, unlike the
engine's own metrics, which reach the EPP a scrape later.

Lifecycle: ``admit`` (routed) → ``first_token`` (prefill done) → ``progress`` (tokens
streamed) → ``finish`` (completed, failed upstream, or cancelled). ``finish`` removes every
trace of the request, so aborted streams leak nothing. Aggregates are updated incrementally:
every call is O(1).

Bookings are keyed by whatever the caller uses to tell routed requests apart. It must be
unique per routed request: client-supplied request ids are not (a client may reuse one, or
retry with it while the first attempt is still being torn down).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    requests: int = 0
    prefill_tokens: int = 0
    """Uncached prompt tokens routed here and not yet prefilled."""
    decode_tokens: int = 0
    """KV tokens (prompt + generated) of requests here that are decoding."""
    expected_remaining_tokens: int = 0
    """Output tokens still expected from requests here (estimates, corrected as tokens arrive)."""
    kv_tokens: int = 0
    """KV tokens (prompt + generated) of every request here, prefilling or decoding: the blocks
    Dynamo's router books as active from the moment it routes a request."""

    @property
    def tokens_in_flight(self) -> int:
        """Prefill still to do plus the KV of decoding requests: the endpoint's token load."""
        return self.prefill_tokens + self.decode_tokens

    def __add__(self, other: EndpointLoad) -> EndpointLoad:
        return EndpointLoad(
            self.requests + other.requests,
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            self.expected_remaining_tokens + other.expected_remaining_tokens,
            self.kv_tokens + other.kv_tokens,
        )

    def __sub__(self, other: EndpointLoad) -> EndpointLoad:
        return EndpointLoad(
            self.requests - other.requests,
            self.prefill_tokens - other.prefill_tokens,
            self.decode_tokens - other.decode_tokens,
            self.expected_remaining_tokens - other.expected_remaining_tokens,
            self.kv_tokens - other.kv_tokens,
        )


NO_LOAD = EndpointLoad()
"""The load of an endpoint with nothing booked."""


def token_cost(
    load: EndpointLoad,
    uncached_prompt_tokens: int,
    prefill_scale: float = 1.0,
    expected_output_weight: float = 0.0,
) -> float:
    """The Dynamo KV router's cost, in tokens, of one more request on an endpoint with ``load``:
    the prefill still to do there (what is booked and the request's uncached prompt tokens,
    times ``prefill_scale``) plus the KV tokens booked there, plus ``expected_output_weight``
    times the output still expected from the requests booked there."""
    prefill = load.prefill_tokens + uncached_prompt_tokens
    return prefill_scale * prefill + load.kv_tokens + expected_output_weight * load.expected_remaining_tokens


class BookingTerms(NamedTuple):
    """What a request was booked with when it was routed."""

    endpoint: str
    prompt_tokens: int
    uncached_tokens: int
    expected_output: int
    """The output estimate (raised since, if more tokens came than expected)."""


@dataclass(slots=True)
class _Booking:
    endpoint: str
    prompt_tokens: int
    uncached_tokens: int
    expected_output: int
    generated: int = 0
    decoding: bool = False

    @property
    def remaining(self) -> int:
        return max(0, self.expected_output - self.generated)


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    expected_remaining_tokens: int = 0
    kv_tokens: int = 0


class TokenLoadTracker:
    def __init__(self) -> None:
        self._bookings: dict[Hashable, _Booking] = {}
        self._totals: dict[str, _Totals] = {}

    def admit(
        self,
        booking_id: Hashable,
        endpoint: str,
        prompt_tokens: int,
        cached_tokens: int,
        expected_output: int,
    ) -> None:
        """Book a request routed to ``endpoint``. Re-admitting an id first releases the old booking."""
        self.finish(booking_id)
        uncached = max(0, prompt_tokens - min(cached_tokens, prompt_tokens))
        booking = _Booking(endpoint, prompt_tokens, uncached, max(1, expected_output))
        self._bookings[booking_id] = booking
        totals = self._totals.setdefault(endpoint, _Totals())
        totals.requests += 1
        totals.prefill_tokens += uncached
        totals.expected_remaining_tokens += booking.remaining
        totals.kv_tokens += prompt_tokens

    def first_token(self, booking_id: Hashable) -> None:
        """Prefill is done: the prompt's tokens move from the prefill to the decode account."""
        booking = self._bookings.get(booking_id)
        if booking is None or booking.decoding:
            return
        totals = self._totals[booking.endpoint]
        booking.decoding = True
        totals.prefill_tokens -= booking.uncached_tokens
        totals.decode_tokens += booking.prompt_tokens + booking.generated
        if booking.generated == 0:
            self.progress(booking_id, 1)

    def progress(self, booking_id: Hashable, generated: int) -> None:
        """``generated`` output tokens so far; the output estimate grows if it was too small."""
        booking = self._bookings.get(booking_id)
        if booking is None or generated <= booking.generated:
            return
        totals = self._totals[booking.endpoint]
        before = booking.remaining
        if booking.decoding:
            totals.decode_tokens += generated - booking.generated
        totals.kv_tokens += generated - booking.generated
        booking.generated = generated
        booking.expected_output = max(booking.expected_output, generated)
        totals.expected_remaining_tokens += booking.remaining - before

    def finish(self, booking_id: Hashable) -> None:
        """The request is over, however it ended: release everything it booked."""
        booking = self._bookings.pop(booking_id, None)
        if booking is None:
            return
        totals = self._totals[booking.endpoint]
        totals.requests -= 1
        totals.expected_remaining_tokens -= booking.remaining
        totals.kv_tokens -= booking.prompt_tokens + booking.generated
        if booking.decoding:
            totals.decode_tokens -= booking.prompt_tokens + booking.generated
        else:
            totals.prefill_tokens -= booking.uncached_tokens
        if totals.requests == 0:
            del self._totals[booking.endpoint]

    def terms(self, booking_id: Hashable) -> BookingTerms | None:
        """The terms ``booking_id`` is booked with (None if it is not booked)."""
        b = self._bookings.get(booking_id)
        if b is None:
            return None
        return BookingTerms(b.endpoint, b.prompt_tokens, b.uncached_tokens, b.expected_output)

    def booking_row(self, booking_id: Hashable) -> tuple[int, int, int, int, int] | None:
        """``booking_id``'s prompt tokens, then what it adds to its endpoint's load now (prefill,
        decode, expected remaining and KV tokens; plain ints, for replica sync's tail rows);
        None if it is not booked."""
        b = self._bookings.get(booking_id)
        if b is None:
            return None
        kv = b.prompt_tokens + b.generated
        return (
            b.prompt_tokens,
            0 if b.decoding else b.uncached_tokens,
            kv if b.decoding else 0,
            b.remaining,
            kv,
        )

    def load(self, endpoint: str) -> EndpointLoad:
        totals = self._totals.get(endpoint)
        if totals is None:
            return EndpointLoad()
        return EndpointLoad(
            totals.requests,
            totals.prefill_tokens,
            totals.decode_tokens,
            totals.expected_remaining_tokens,
            totals.kv_tokens,
        )

    def in_flight(self) -> int:
        return len(self._bookings)
