"""Rendezvous owners of endpoints (``epp.sync.scrape_owners``): one owner each, the same whatever
the order, only the joiner's or leaver's endpoints move, and a fair share each."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from epp.sync.scrape_owners import ScrapeOwners, owner, weight

names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)
replica_sets = st.sets(names, min_size=1, max_size=8)
endpoint_lists = st.lists(names, min_size=1, max_size=40, unique=True)


@given(replica_sets, endpoint_lists)
def test_every_endpoint_has_one_owner_among_the_replicas_whatever_their_order(
    replicas: set[str], endpoints: list[str]
) -> None:
    for endpoint in endpoints:
        chosen = owner(endpoint, sorted(replicas))
        assert chosen in replicas
        assert owner(endpoint, sorted(replicas, reverse=True)) == chosen
        # Exactly one: the owner's weight beats every other replica's.
        assert all(weight(chosen, endpoint) >= weight(r, endpoint) for r in replicas)


@given(replica_sets, names, endpoint_lists)
def test_a_replica_that_joins_takes_endpoints_only_for_itself(
    replicas: set[str], joiner: str, endpoints: list[str]
) -> None:
    before = {e: owner(e, replicas) for e in endpoints}
    after = {e: owner(e, replicas | {joiner}) for e in endpoints}
    assert all(after[e] == joiner for e in endpoints if before[e] != after[e])


@given(replica_sets, names, endpoint_lists)
def test_a_replica_that_leaves_hands_on_only_its_own_endpoints(
    replicas: set[str], leaver: str, endpoints: list[str]
) -> None:
    everyone = replicas | {leaver}
    if len(everyone) < 2:
        return
    before = {e: owner(e, everyone) for e in endpoints}
    after = {e: owner(e, everyone - {leaver}) for e in endpoints}
    assert {e for e in endpoints if before[e] != after[e]} == {e for e in endpoints if before[e] == leaver}


def test_each_of_k_replicas_owns_about_one_kth_of_the_endpoints() -> None:
    endpoints = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(1_000)]
    for k in (2, 3, 4, 8):
        replicas = [f"epp-{i}" for i in range(k)]
        shares = Counter(owner(e, replicas) for e in endpoints)
        assert set(shares) == set(replicas)
        # Binomial(1000, 1/k): within four standard deviations of 1000/k.
        spread = 4 * (1_000 * (1 / k) * (1 - 1 / k)) ** 0.5
        assert all(abs(n - 1_000 / k) <= spread for n in shares.values()), (k, shares)
    # One more replica moves about 1/(k+1) of the endpoints, all to it.
    four = {e: owner(e, [f"epp-{i}" for i in range(4)]) for e in endpoints}
    five = {e: owner(e, [f"epp-{i}" for i in range(5)]) for e in endpoints}
    moved = [e for e in endpoints if four[e] != five[e]]
    assert {five[e] for e in moved} == {"epp-4"} and 150 <= len(moved) <= 250


def test_the_cache_follows_the_set_of_replicas() -> None:
    owners = ScrapeOwners()
    endpoints = [f"e{i}" for i in range(50)]
    for replicas in (frozenset({"a"}), frozenset({"a", "b"}), frozenset({"a", "b", "c"}), frozenset({"b"})):
        assert [owners.owner(e, replicas) for e in endpoints] == [owner(e, replicas) for e in endpoints]
    owners.forget("e0")
    assert owners.owner("e0", frozenset({"b"})) == "b"
