"""The typed bodies of sync messages (``epp.sync.deltas``): the same bytes as the schema's arrays."""

from __future__ import annotations

import msgpack
import pytest

from epp.sync.deltas import Heartbeat, PrefixInsert, Snapshot, Totals
from epp.sync.messages import Capability, MessageKind, SyncMessage, encode, pack_hashes

ROWS = pack_hashes(range(6))
TOTALS = Totals("10.0.0.1:8000", 2, 100, 310, 25, 410, 40.0, ROWS)
INSERT = PrefixInsert("10.0.0.1:8000", 64, pack_hashes([7, 8]))


def test_deltas_encode_as_the_schemas_positional_arrays() -> None:
    body = [INSERT.delta(), TOTALS.delta()]
    data = encode(SyncMessage(MessageKind.DELTAS, "a", 1, 3, 2.5, body))
    golden = msgpack.packb(
        [
            4,
            1,
            "a",
            1,
            3,
            2.5,
            [
                [5, "10.0.0.1:8000", 64, pack_hashes([7, 8])],
                [6, "10.0.0.1:8000", 2, 100, 310, 25, 410, 40.0, ROWS],
            ],
        ],
        use_bin_type=True,
    )
    assert data == golden


def test_fields_read_back_as_the_delta() -> None:
    assert Totals.read(TOTALS.fields()) == TOTALS
    assert PrefixInsert.read(INSERT.fields()) == INSERT
    assert Snapshot.read(Snapshot.body([TOTALS], [INSERT])) == ([TOTALS.fields()], [INSERT.fields()])
    beat = Heartbeat(Capability.SHARES_SCRAPES, 3.5)
    assert beat.body() == [1, 3.5] and Heartbeat.read(beat.body()) == beat
    assert Heartbeat(Capability.NONE, None).body() == [0]


@pytest.mark.parametrize(
    "fields",
    [
        ["e", 1, 2, 3, 4],  # too short
        ["e", 1, 2, 3, 4, 5, None, b"\x01"],  # tail rows not whole
        ["e", 1, -2, 3, 4, 5, None, b""],  # a negative count
        ["e", 1.0, 2, 3, 4, 5, None, b""],  # a float where a count belongs
        ["e", 1, 2, 3, 4, 5, 0, b""],  # a TPOT SLO that is no SLO
        [7, 1, 2, 3, 4, 5, None, b""],  # an endpoint that is no name
        ("e", 1, 2, 3, 4, 5, None, b""),  # not a msgpack array as decoded
    ],
)
def test_malformed_totals_are_refused(fields: object) -> None:
    assert Totals.read(fields) is None


@pytest.mark.parametrize("fields", [["e", 64], ["e", 64, b"\x01"], [None, 64, b""], "e"])
def test_malformed_prefix_inserts_are_refused(fields: object) -> None:
    assert PrefixInsert.read(fields) is None


def test_a_snapshot_that_is_not_two_lists_is_refused() -> None:
    assert Snapshot.read([[]]) is None and Snapshot.read([[], "prefix"]) is None
