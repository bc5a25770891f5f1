"""Peers' published per-endpoint totals (``epp.load.peer_totals``): replaced whole, summed over
the peers, and a continued turn's booking left out while its peer still lists it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.load.peer_totals import NO_COUNTS, Counts, PeerTotals
from epp.load.token_load import NO_LOAD, EndpointLoad
from tests.epp.factories import tail_rows


def prefilling(*prompts: int) -> Counts:
    """The totals of not yet prefilled bookings of these prompts, 30 tokens expected each."""
    return (len(prompts), sum(prompts), 0, 30 * len(prompts), sum(prompts))


def load(counts: Counts) -> EndpointLoad:
    return EndpointLoad(*counts)


def test_a_peers_totals_replace_what_it_published_before_and_add_to_the_others() -> None:
    peers = PeerTotals()
    peers.replace("p", "e0", prefilling(100))
    peers.replace("p", "e0", prefilling(100))  # the same again: idempotent
    peers.replace("q", "e0", prefilling(50, 50))
    assert peers.load("e0") == load(prefilling(100, 50, 50)) and peers.in_flight() == 3
    peers.replace("p", "e0", prefilling(300))
    assert peers.load("e0") == load(prefilling(300, 50, 50))
    peers.replace("p", "e0", NO_COUNTS)  # nothing left there
    assert peers.load("e0") == load(prefilling(50, 50)) and peers.in_flight() == 2


def test_tail_rows_that_are_not_whole_are_refused() -> None:
    with pytest.raises(ValueError):
        PeerTotals().replace("p", "e0", prefilling(100), tail_rows((7, 100))[:-1])


def test_clearing_a_peer_takes_all_it_published_and_its_tails() -> None:
    peers = PeerTotals()
    peers.replace("p", "e0", prefilling(100), tail_rows((7, 100)))
    peers.replace("p", "e1", prefilling(200))
    peers.replace("q", "e1", prefilling(50))
    assert peers.has_tails()
    peers.clear("p")
    assert peers.load("e0") == NO_LOAD and peers.load("e1") == load(prefilling(50))
    assert peers.in_flight() == 1 and not peers.has_tails()
    assert not peers.continue_turn("e0", 7, 1000)


def test_a_continued_turn_stays_out_while_listed_and_its_peers_release_settles_it() -> None:
    peers = PeerTotals()
    peers.replace("p", "e0", prefilling(320, 100), tail_rows((20, 320)))
    assert not peers.continue_turn("e0", 20, 320)  # not longer: the same prompt again
    assert not peers.continue_turn("e1", 20, 400)  # another endpoint
    assert peers.continue_turn("e0", 20, 400)
    assert peers.load("e0") == load(prefilling(100)) and peers.in_flight() == 1
    assert not peers.continue_turn("e0", 20, 500)  # already left
    # A publication made before the peer's release, arriving after: still left out.
    peers.replace("p", "e0", prefilling(320, 100, 60), tail_rows((20, 320)))
    assert peers.load("e0") == load(prefilling(100, 60))
    peers.replace("p", "e0", prefilling(100, 60))  # the release itself
    assert peers.load("e0") == load(prefilling(100, 60)) and peers.in_flight() == 2
    # A later booking with that tail (the conversation came back) counts again.
    peers.replace("p", "e0", prefilling(320, 100, 60), tail_rows((20, 320)))
    assert peers.load("e0") == load(prefilling(320, 100, 60))


def test_a_tail_that_several_bookings_end_at_continues_none() -> None:
    peers = PeerTotals()
    peers.replace("p", "e0", prefilling(160), tail_rows((10, 160)))
    peers.replace("q", "e0", prefilling(160), tail_rows((10, 160)))
    assert not peers.continue_turn("e0", 10, 400)  # a prefix shared by two peers' requests
    peers.replace("q", "e0", prefilling(160, 160), tail_rows((11, 160), (11, 160)))
    assert not peers.continue_turn("e0", 11, 400)  # shared by two of one peer's
    assert peers.continue_turn("e0", 10, 400)  # q no longer ends at 10
    assert peers.load("e0") == load(prefilling(160, 160))


publications = st.lists(
    st.tuples(
        st.sampled_from("pqr"), st.sampled_from(["e0", "e1"]), st.lists(st.integers(1, 500), max_size=4)
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(publications)
def test_the_sums_are_each_peers_latest_publication_summed(ops) -> None:
    peers, latest = PeerTotals(), {}
    for peer, endpoint, prompts in ops:
        peers.replace(peer, endpoint, prefilling(*prompts))
        latest[(peer, endpoint)] = prefilling(*prompts)
    for endpoint in ("e0", "e1"):
        expected = sum((load(v) for (_, e), v in latest.items() if e == endpoint), NO_LOAD)
        assert peers.load(endpoint) == expected
    assert peers.in_flight() == sum(v[0] for v in latest.values())
