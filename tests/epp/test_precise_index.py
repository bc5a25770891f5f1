"""The precise prefix index against a plain reference model (a set of block hashes per endpoint)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.kvcache import precise_index
from epp.kvcache.precise_index import PreciseIndex

ENDPOINTS = ["a", "b", "c", "d"]
# Small values collide in a tiny table; 0 and 2**64 - 1 are the edges of the key space.
HASHES = st.one_of(st.integers(0, 24), st.sampled_from([2**64 - 1, 2**64 - 2, 2**63]))


class Reference:
    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.orphans: dict[str, int] = {}

    def longest_prefix(self, chain: Sequence[int]) -> dict[str, int]:
        matched = {}
        for endpoint, held in self.blocks.items():
            depth = 0
            while depth < len(chain) and chain[depth] in held:
                depth += 1
            if depth:
                matched[endpoint] = depth
        return matched


def apply(index: PreciseIndex, ref: Reference, op: tuple) -> None:
    kind, endpoint, *args = op
    if kind == "add":
        index.add_endpoint(endpoint)
        ref.blocks.setdefault(endpoint, set())
        ref.orphans.setdefault(endpoint, 0)
    elif endpoint not in ref.blocks:
        return  # events only come for tracked endpoints
    elif kind == "store":
        parent, hashes = args
        if parent is not None and parent not in ref.blocks[endpoint]:
            ref.orphans[endpoint] += 1
        index.store(endpoint, hashes, parent)
        ref.blocks[endpoint].update(hashes)
    elif kind == "remove":
        index.remove(endpoint, args[0])
        ref.blocks[endpoint].difference_update(args[0])
    elif kind == "clear":
        index.clear(endpoint)
        ref.blocks[endpoint] = set()
    else:
        index.remove_endpoint(endpoint)
        del ref.blocks[endpoint], ref.orphans[endpoint]


def check(index: PreciseIndex, ref: Reference, chains: Sequence[Sequence[int]]) -> None:
    assert sorted(index.endpoints()) == sorted(ref.blocks)
    assert len(index) == len(set().union(*ref.blocks.values()))
    for endpoint, held in ref.blocks.items():
        assert index.blocks_held(endpoint) == len(held)
        assert index.orphans(endpoint) == ref.orphans[endpoint]
        assert all(index.holds(endpoint, h) for h in held)
    for chain in chains:
        assert index.longest_prefix(chain) == ref.longest_prefix(chain)


OPS = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(ENDPOINTS)),
    st.tuples(
        st.just("store"), st.sampled_from(ENDPOINTS), st.none() | HASHES, st.lists(HASHES, max_size=12)
    ),
    st.tuples(st.just("remove"), st.sampled_from(ENDPOINTS), st.lists(HASHES, max_size=12)),
    st.tuples(st.just("clear"), st.sampled_from(ENDPOINTS)),
    st.tuples(st.just("forget"), st.sampled_from(ENDPOINTS)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPS, max_size=60), chains=st.lists(st.lists(HASHES, max_size=10), max_size=6))
def test_matches_the_reference_model_under_any_event_sequence(
    ops: list[tuple], chains: list[list[int]]
) -> None:
    # A 4-slot table makes every probe collide and every few stores resize or compact it.
    with mock.patch.object(precise_index, "_MIN_BITS", 2):
        index, ref = PreciseIndex(), Reference()
        for op in ops:
            apply(index, ref, op)
            check(index, ref, chains)


def test_long_random_histories_across_more_than_64_endpoints() -> None:
    rng = random.Random(5)
    names = [f"e{i}" for i in range(70)]
    index, ref = PreciseIndex(), Reference()
    pool = [rng.getrandbits(64) for _ in range(3000)]
    for name in names:
        apply(index, ref, ("add", name))
    for step in range(3000):
        name = rng.choice(names)
        roll = rng.random()
        if roll < 0.7:
            apply(index, ref, ("store", name, None, rng.sample(pool, 8)))
        elif roll < 0.97:
            apply(index, ref, ("remove", name, rng.sample(pool, 8)))
        elif roll < 0.99:
            apply(index, ref, ("clear", name))
        else:
            apply(index, ref, ("forget", name))
            apply(index, ref, ("add", name))
        if step % 500 == 0:
            check(index, ref, [rng.sample(pool, 20) for _ in range(5)])
    check(index, ref, [pool[:50], pool[100:300]])


def test_a_chain_matches_only_up_to_an_endpoints_first_missing_block() -> None:
    index = PreciseIndex()
    for name in "abc":
        index.add_endpoint(name)
    chain = [11, 12, 13, 14]
    index.store("a", chain)
    index.store("b", chain[:2])
    index.store("c", chain[1:])  # holds later blocks but not the first: no prefix
    assert index.longest_prefix(chain) == {"a": 4, "b": 2}
    index.remove("a", [13])
    assert index.longest_prefix(chain) == {"a": 2, "b": 2}
    index.clear("b")
    assert index.longest_prefix(chain) == {"a": 2}
    assert index.blocks_held("c") == 3 and len(index) == 4


def test_orphan_stores_are_counted_and_still_indexed() -> None:
    index = PreciseIndex()
    index.add_endpoint("a")
    index.store("a", [1, 2])
    index.store("a", [3], parent=2)
    index.store("a", [9], parent=8)  # its parent was never stored here: events were missed
    assert index.orphans("a") == 1 and index.holds("a", 9)


def test_staleness_is_per_tracked_endpoint() -> None:
    index = PreciseIndex()
    assert not index.is_live("a")  # untracked: no events source
    index.add_endpoint("a")
    assert index.is_live("a")
    index.set_stale("a", True)
    assert not index.is_live("a")
    index.set_stale("a", False)
    assert index.is_live("a")
    index.set_stale("a", True)
    index.remove_endpoint("a")
    index.add_endpoint("a")
    assert index.is_live("a")


def test_memory_is_about_32_bytes_a_block() -> None:
    # A million blocks take 32 MiB (measured by the kv-index benchmark); a fifth here, for time.
    index = PreciseIndex()
    for i in range(64):
        index.add_endpoint(f"e{i}")
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) for _ in range(200_000)]
    index.store("e0", hashes)
    assert len(index) == 200_000
    assert index.nbytes <= 48 * len(index)
    assert index.longest_prefix(hashes[:3125]) == {"e0": 3125}
    index.clear("e0")
    assert len(index) == 0 and index.nbytes < 2**20
