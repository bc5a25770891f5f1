"""The sync wire schema: msgpack arrays, version first, so any reader can refuse what it does not know.

Every message is ``[version, kind, replica, incarnation, seq, sent_at, body]``:

* ``replica`` names the sender; ``incarnation`` tells its process lives apart (a restarted
  replica keeps its name and starts a new incarnation, so peers drop what the old one booked);
* ``seq`` numbers the sender's DELTAS messages 1, 2, 3, ... within an incarnation; HEARTBEAT and
  SNAPSHOT carry the sender's latest ``seq``, so a receiver can tell it missed some;
* ``sent_at`` is the sender's wall clock (seconds since the epoch), for the publish→apply lag.

Bodies (typed, field by field, in ``epp.sync.deltas``):

* DELTAS: a list of deltas, each a list starting with its :class:`DeltaKind`::

      [TOTALS, endpoint, requests, prefill_tokens, decode_tokens, expected_remaining_tokens,
       kv_tokens, min_tpot_slo_ms | None, tail_rows]
      [PREFIX, endpoint, block_size, hashes]   # hashes: little-endian uint64 bytes

  TOTALS is the sender's own load on ``endpoint`` now (absolute, not a change: the receiver
  replaces what it held; ``requests`` 0: nothing left there), with the smallest TPOT SLO among
  its streaming requests there (None: none runs). ``tail_rows`` lists its live bookings there
  that name their prompt's tail, as little-endian uint64 bytes, 6 per booking
  (``epp.load.peer_totals.pack_tail_rows``): ``tail, prompt_tokens, prefill_tokens,
  decode_tokens, expected_remaining_tokens, kv_tokens``, where ``tail`` is the hash of the
  prompt's last full block in the prefix match's chain (it names the whole prompt up to there),
  by which a peer recognises a conversation's next turn.
* SNAPSHOT: ``[totals, prefix]``: the sender's TOTALS for every endpoint where it has bookings,
  each without the leading kind, and the most recent blocks of its approximate prefix index (its
  own inserts and its peers'), each ``[endpoint, block_size, hashes]``, oldest first (bounded,
  ``SyncTuning.snapshot_prefix_blocks``).
* HEARTBEAT: ``[capabilities]``, a bit set of what the sender does (:class:`Capability`);
  an empty body, as replicas before scrape sharing send, has none. Readers take the first item
  if it is an int and ignore the rest, so later versions may append; readers before scrape
  sharing never looked at a heartbeat's body. A replica that routes on estimated token ids
  calibrated on its tokenizer (``--tokenize-every``, ``epp.tokenizer.sampling``) appends the
  estimate's bytes per token, once it has one, so that replicas agree on it:
  ``[capabilities, bytes_per_token]``.
* SNAPSHOT_REQUEST: empty.
* SCRAPES (only on the scrapes subject, ``epp.sync.nats_transport``, which replicas before scrape
  sharing do not subscribe to; ``seq`` is 0): a list of the sender's latest scrapes of endpoints
  it owns (``epp.sync.scrape_share``), each ``[endpoint, age_s, period_s, result]``: ``age_s``
  seconds since the scrape's answer (or failure), as of ``sent_at`` (so the clocks need not
  agree), ``period_s`` the sender's wait before its next scrape of it, and ``result`` either the
  figures ``[waiting, running, kv_cache_usage, block_size | None, num_gpu_blocks | None]`` or a
  str, why the endpoint is out of scheduling (the scrape failed).

Version 4 is the only one (versions 1–3 sent one delta per step of each request: routed, first
token, progress, released); a message of any other version is refused whole (:class:`SchemaError`).
Scrape sharing added the heartbeat's capabilities and SCRAPES within version 4: a replica before
it reads the new heartbeat (it ignores the body), never receives SCRAPES, and announces no
capability, so it owns no endpoint and every endpoint keeps being scraped.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum, IntFlag
from typing import Any, NamedTuple

import msgpack
import numpy as np

SCHEMA_VERSION = 4


class MessageKind(IntEnum):
    DELTAS = 1
    HEARTBEAT = 2
    SNAPSHOT = 3
    SNAPSHOT_REQUEST = 4
    SCRAPES = 5


class Capability(IntFlag):
    """What a replica announces in its heartbeat."""

    NONE = 0
    SHARES_SCRAPES = 1
    """It scrapes the endpoints it owns and publishes SCRAPES, and skips others' while theirs are fresh."""


class DeltaKind(IntEnum):
    # 1-4 were version 3's per-request deltas.
    PREFIX = 5
    TOTALS = 6


_DELTA_NAMES = {k.value: k.name.lower() for k in DeltaKind}


def delta_name(kind: object) -> str:
    """The metric label of a delta's kind (``unknown`` for kinds this version does not know)."""
    return _DELTA_NAMES.get(kind, "unknown") if isinstance(kind, int) else "unknown"


class SchemaError(ValueError):
    """A message this replica cannot read. ``reason`` is ``version`` (another schema version,
    in ``version``) or ``malformed`` (not a message of any version)."""

    def __init__(self, reason: str, detail: str, version: object = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.version = version


class SyncMessage(NamedTuple):
    """One message's envelope and its body (a NamedTuple, not a frozen dataclass: every message
    received builds one, and a frozen dataclass's init costs a ``__setattr__`` call per field)."""

    kind: MessageKind
    replica: str
    incarnation: int
    seq: int
    sent_at: float
    body: Sequence[Any] = ()


def encode(message: SyncMessage) -> bytes:
    return msgpack.packb(
        [
            SCHEMA_VERSION,
            int(message.kind),
            message.replica,
            message.incarnation,
            message.seq,
            message.sent_at,
            list(message.body),
        ],
        use_bin_type=True,
    )


# Looked up, not called: MessageKind(kind) runs two Python frames of the enum machinery, on
# every message received (the apply path, ``llm-epp-bench sync-apply``).
_MESSAGE_KINDS: dict[object, MessageKind] = {k.value: k for k in MessageKind}
_NUMBER = (int, float)


def decode(data: bytes) -> SyncMessage:
    """The message in ``data``; :class:`SchemaError` if its version is not ours or it is no message.

    Only the envelope is checked here; each delta is checked as it is applied."""
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError("malformed", f"a message that is not msgpack ({exc})") from None
    if not isinstance(fields, list) or not fields:
        raise SchemaError("malformed", "a message that is no msgpack array")
    version = fields[0]
    if version != SCHEMA_VERSION:
        raise SchemaError(
            "version", f"schema version {version!r} (this replica reads {SCHEMA_VERSION})", version
        )
    if len(fields) != 7:
        raise SchemaError("malformed", f"a version {SCHEMA_VERSION} message with {len(fields)} fields, not 7")
    _, kind, replica, incarnation, seq, sent_at, body = fields
    if (
        (known_kind := _MESSAGE_KINDS.get(kind)) is None
        or not isinstance(replica, str)
        or not isinstance(incarnation, int)
        or not isinstance(seq, int)
        or not isinstance(sent_at, _NUMBER)
        or not isinstance(body, list)
    ):
        raise SchemaError("malformed", "a message with bad envelope field types")
    return SyncMessage(known_kind, replica, incarnation, seq, float(sent_at), body)


_KNOWN_CAPABILITIES = sum(Capability)


def heartbeat_capabilities(body: Sequence[Any]) -> Capability:
    """The capabilities a HEARTBEAT's body announces (none when it is empty or unreadable);
    bits this version does not know are dropped."""
    first = body[0] if body else None
    if type(first) is not int:
        return Capability.NONE
    return Capability(first & _KNOWN_CAPABILITIES)


def heartbeat_bytes_per_token(body: Sequence[Any]) -> float | None:
    """The estimate's bytes per token a HEARTBEAT's body announces (None: none, or unreadable)."""
    second = body[1] if len(body) > 1 else None
    if type(second) not in (int, float) or not 1 <= second <= 8:
        return None
    return float(second)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    return np.asarray(hashes, dtype="<u8").tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    """The block hashes packed by :func:`pack_hashes`; ValueError if ``data`` is not whole uint64s."""
    return np.frombuffer(data, dtype="<u8").tolist()
