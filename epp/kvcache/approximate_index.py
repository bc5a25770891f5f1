"""Approximate prefix index: which endpoint was last sent which prompt blocks.

The EPP cannot see an engine's cache without KV events, so it assumes that a prompt's
blocks stay cached on the endpoint it was routed to until that endpoint has been sent
``capacity`` newer blocks (a per-endpoint LRU). Blocks are named by a chained xxhash64 over
fixed-size token blocks, seeded with the model name and cache salt, so equal prefixes under
different models or salts never match.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed_text: str = "",
    max_blocks: int | None = None,
    known: Sequence[int] = (),
) -> list[int]:
    """Chained 64-bit hashes of the full ``block_size`` blocks of ``token_ids`` (at most ``max_blocks``).

    ``known``: the hashes of leading blocks already computed (with the same block size and seed),
    which are kept; only the blocks after them are hashed.
    """
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if len(known) >= n_blocks:
        return list(known[:n_blocks])
    begin = len(known) * block_size
    # array packs a list of ints into uint32 bytes three times faster than numpy.asarray.
    data = array("I", token_ids[begin : n_blocks * block_size]).tobytes()
    step = block_size * 4
    parent = known[-1] if known else xxhash.xxh64_intdigest(seed_text.encode())
    hashes = list(known)
    for offset in range(0, len(data), step):
        parent = xxhash.xxh64_intdigest(data[offset : offset + step], seed=parent)
        hashes.append(parent)
    return hashes


class ApproximatePrefixIndex:
    """Block hash → endpoints that (probably) hold it, with an LRU of blocks per endpoint."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, endpoint: str, block_hashes: Iterable[int], capacity: int) -> None:
        """Note that ``endpoint`` now caches these blocks, keeping its ``capacity`` most recent."""
        lru, holders_of = self._lru.setdefault(endpoint, OrderedDict()), self._holders
        for h in block_hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if (holders := holders_of.get(h)) is None:
                holders_of[h] = {endpoint}
            else:
                holders.add(endpoint)
        while len(lru) > max(1, capacity):
            evicted, _ = lru.popitem(last=False)
            self._forget(evicted, endpoint)

    def _forget(self, block: int, endpoint: str) -> None:
        holders = self._holders.get(block)
        if holders is None:
            return
        holders.discard(endpoint)
        if not holders:
            del self._holders[block]

    def remove_endpoint(self, endpoint: str) -> None:
        for h in self._lru.pop(endpoint, ()):
            self._forget(h, endpoint)

    def longest_prefix(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Number of leading blocks of ``block_hashes`` each endpoint holds (endpoints with 0 omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] = set()
        depth = 0
        for h in block_hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            if depth == 0:
                alive = set(holders)
            elif not alive <= holders:  # some endpoints' runs end here (the rare case: a set op)
                for endpoint in alive - holders:
                    matched[endpoint] = depth
                alive &= holders
                if not alive:
                    break
            depth += 1
        for endpoint in alive:
            matched[endpoint] = depth
        return matched

    def recent_blocks(self, limit: int) -> list[tuple[str, list[int]]]:
        """Each endpoint's most recently sent blocks, oldest first, at most ``limit`` in all (an
        equal share per endpoint): recording them in this order rebuilds the same LRU order."""
        if limit <= 0 or not self._lru:
            return []
        share = max(1, limit // len(self._lru))
        return [(e, list(lru)[-share:]) for e, lru in self._lru.items() if lru]

    def blocks_held(self, endpoint: str) -> int:
        return len(self._lru.get(endpoint, ()))
