from __future__ import annotations

import struct
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh64_intdigest

from epp.kvcache.approximate_index import ApproximatePrefixIndex, prefix_block_hashes


def test_hashes_are_chained_and_seeded() -> None:
    a = prefix_block_hashes(list(range(40)), 8)
    assert len(a) == 5
    b = prefix_block_hashes([99, *range(1, 40)], 8)
    assert a[0] != b[0] and all(
        x != y for x, y in zip(a, b, strict=True)
    )  # a change propagates down the chain
    assert prefix_block_hashes(list(range(40)), 8, seed_text="m2") != a
    assert prefix_block_hashes(list(range(40)), 8, max_blocks=2) == a[:2]


def test_each_block_hashes_its_ids_as_uint32_little_endian_seeded_by_the_last() -> None:
    """The format peers and restarts share: xxh64 of the block's ids as 4-byte ints, chained."""
    tokens = [0, 1, 70_000, 2**32 - 1, 5, 6, 7, 8] * 3 + [9]
    parent, expected = xxh64_intdigest(b"m\x00"), []
    for start in range(0, 24, 8):
        parent = xxh64_intdigest(struct.pack("<8I", *tokens[start : start + 8]), seed=parent)
        expected.append(parent)
    assert prefix_block_hashes(tokens, 8, seed_text="m\x00") == expected
    assert prefix_block_hashes(tokens, 8, seed_text="m\x00", known=expected[:2]) == expected


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.lists(st.sampled_from("abcd"), max_size=4), max_size=12))
def test_longest_prefix_is_each_endpoints_run_of_leading_blocks(blocks: list[list[str]]) -> None:
    index = ApproximatePrefixIndex()
    for block, holders in enumerate(blocks):
        for endpoint in holders:
            index.record(endpoint, [block], capacity=100)
    expected = {}
    for endpoint in "abcd":
        run = 0
        while run < len(blocks) and endpoint in blocks[run]:
            run += 1
        if run:
            expected[endpoint] = run
    assert index.longest_prefix(list(range(len(blocks)))) == expected


def test_longest_prefix_counts_leading_blocks_only() -> None:
    index = ApproximatePrefixIndex()
    index.record("a", [1, 2, 3], capacity=10)
    index.record("b", [1, 9], capacity=10)
    assert index.longest_prefix([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.longest_prefix([7, 2, 3]) == {}  # a miss on the first block ends the match


def test_lru_evicts_least_recently_routed_blocks() -> None:
    index = ApproximatePrefixIndex()
    index.record("a", [1, 2], capacity=3)
    index.record("a", [3], capacity=3)
    index.record("a", [1], capacity=3)  # touch 1: now 2 is the oldest
    index.record("a", [4], capacity=3)
    assert index.longest_prefix([2]) == {}
    assert index.longest_prefix([1]) == {"a": 1}
    index.remove_endpoint("a")
    assert index.longest_prefix([1]) == {} and index.blocks_held("a") == 0


class ReferenceIndex:
    """Obviously-correct model: per-endpoint ordered list of blocks."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, endpoint: str, blocks: list[int], capacity: int) -> None:
        lru = self.lru.setdefault(endpoint, OrderedDict())
        for b in blocks:
            lru.pop(b, None)
            lru[b] = None
        while len(lru) > capacity:
            lru.popitem(last=False)

    def longest_prefix(self, blocks: list[int]) -> dict[str, int]:
        result = {}
        for endpoint, lru in self.lru.items():
            depth = 0
            for b in blocks:
                if b not in lru:
                    break
                depth += 1
            if depth:
                result[endpoint] = depth
        return result


operations = st.lists(
    st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 12), max_size=6), st.integers(1, 8)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.lists(st.integers(0, 12), max_size=6))
def test_index_matches_reference_model(ops: list[tuple[str, list[int], int]], query: list[int]) -> None:
    index, reference = ApproximatePrefixIndex(), ReferenceIndex()
    for endpoint, blocks, capacity in ops:
        index.record(endpoint, blocks, capacity)
        reference.record(endpoint, blocks, capacity)
    assert index.longest_prefix(query) == reference.longest_prefix(query)


def test_recent_blocks_are_each_endpoints_newest_in_lru_order_within_the_limit() -> None:
    index = ApproximatePrefixIndex()
    index.record("a", [1, 2, 3, 4], capacity=10)
    index.record("a", [2], capacity=10)  # touched again: now the newest
    index.record("b", [7, 8], capacity=10)
    assert index.recent_blocks(4) == [("a", [4, 2]), ("b", [7, 8])]
    assert index.recent_blocks(100) == [("a", [1, 3, 4, 2]), ("b", [7, 8])]
    assert index.recent_blocks(0) == []
    rebuilt = ApproximatePrefixIndex()
    for endpoint, blocks in index.recent_blocks(100):
        rebuilt.record(endpoint, blocks, capacity=10)
    assert rebuilt.recent_blocks(100) == index.recent_blocks(100)
