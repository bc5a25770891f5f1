"""Precise prefix index: which endpoint's engine holds which KV block, as its KV events say.

Keys are the 64-bit block hashes vLLM publishes in ``BlockStored`` / ``BlockRemoved``. Each
hash names its block's whole prefix (the hashes are chained), so a flat table answers
longest-prefix queries without a tree: a prompt's block *i* is cached on an endpoint when the
endpoint holds hash *i* and every hash before it. ``parent_block_hash`` is therefore checked,
not needed: a store whose parent the endpoint does not hold counts as an orphan (the engine
stores new blocks only after their cached parent, so an orphan means events were missed).

Memory: an open-addressing hash table (linear probing, backward-shift deletion, at most 2/3
full) in two numpy arrays: the uint64 keys, and per key a bitmask of the endpoints holding it
(one uint64 word per 64 endpoints). With up to 64 endpoints a million blocks take 32 MiB,
where a ``dict`` of ``set``s takes several times that. Lookups are vectorised.

Besides blocks, the index keeps which tracked endpoints are *stale*: their events stopped, so
their entries cannot be trusted and a consumer falls back to something else (the data layer
sets it; see ``epp.datalayer.kv_events``). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_FIBONACCI = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_MIN_BITS = 10
_WORD = 64


class PreciseIndex:
    """Block hash → endpoints holding it, per endpoint as its engine reported."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        """Tracked endpoint → its bit in the masks."""
        self._blocks: dict[str, int] = {}
        self._orphans: dict[str, int] = {}
        self._stale: set[str] = set()
        self._words = 1
        self._allocate(_MIN_BITS)

    # ------------------------------------------------------------------ endpoints

    def add_endpoint(self, endpoint: str) -> None:
        """Track ``endpoint`` (no blocks yet; live until marked stale). Idempotent."""
        if endpoint in self._slots:
            return
        used = set(self._slots.values())
        slot = next(s for s in range(len(used) + 1) if s not in used)
        if slot >= self._words * _WORD:
            self._words += 1
            self._masks = np.hstack([self._masks, np.zeros((len(self._masks), 1), np.uint64)])
        self._slots[endpoint] = slot
        self._blocks[endpoint] = 0
        self._orphans[endpoint] = 0

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget ``endpoint`` and every block it held."""
        if endpoint not in self._slots:
            return
        self.clear(endpoint)
        del self._slots[endpoint], self._blocks[endpoint], self._orphans[endpoint]
        self._stale.discard(endpoint)

    def endpoints(self) -> list[str]:
        return list(self._slots)

    def set_stale(self, endpoint: str, stale: bool) -> None:
        if endpoint in self._slots and stale:
            self._stale.add(endpoint)
        else:
            self._stale.discard(endpoint)

    def is_live(self, endpoint: str) -> bool:
        """Tracked and not stale: the endpoint's entries are its engine's current cache."""
        return endpoint in self._slots and endpoint not in self._stale

    def blocks_held(self, endpoint: str) -> int:
        return self._blocks.get(endpoint, 0)

    def orphans(self, endpoint: str) -> int:
        """Stores whose parent block ``endpoint`` did not hold."""
        return self._orphans.get(endpoint, 0)

    def __len__(self) -> int:
        """Distinct blocks held by any endpoint."""
        return self._used + int(self._masks[self._cap].any())

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._masks.nbytes

    # ------------------------------------------------------------------ events

    def store(self, endpoint: str, block_hashes: Iterable[int], parent: int | None = None) -> None:
        """``BlockStored``: the endpoint now holds these blocks (the first one's parent given)."""
        word, bit = self._bit(endpoint)
        if parent is not None and not self.holds(endpoint, parent):
            self._orphans[endpoint] += 1
        added = 0
        for h in block_hashes:
            row = self._row_for_insert(h)
            if not int(self._masks[row, word]) & bit:
                self._masks[row, word] |= np.uint64(bit)
                added += 1
        self._blocks[endpoint] += added

    def remove(self, endpoint: str, block_hashes: Iterable[int]) -> None:
        """``BlockRemoved``: the endpoint evicted these blocks (unknown ones are ignored)."""
        word, bit = self._bit(endpoint)
        removed = 0
        for h in block_hashes:
            row = self._find(h)
            if row < 0 or not int(self._masks[row, word]) & bit:
                continue
            self._masks[row, word] &= np.uint64(~bit & _M64)
            removed += 1
            if row != self._cap and not self._masks[row].any():
                self._delete(row)
        self._blocks[endpoint] -= removed

    def clear(self, endpoint: str) -> None:
        """``AllBlocksCleared`` (or lost events): the endpoint holds nothing; others keep theirs."""
        word, bit = self._bit(endpoint)
        if self._blocks[endpoint] == 0:
            return
        self._masks[:, word] &= np.uint64(~bit & _M64)
        self._blocks[endpoint] = 0
        self._compact()

    def holds(self, endpoint: str, block_hash: int) -> bool:
        slot = self._slots.get(endpoint)
        if slot is None:
            return False
        row = self._find(block_hash)
        return row >= 0 and bool(int(self._masks[row, slot // _WORD]) >> (slot % _WORD) & 1)

    # ------------------------------------------------------------------ lookup

    def longest_prefix(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each endpoint holds (endpoints with 0 omitted).

        Stale endpoints are answered too; :meth:`is_live` says whether to trust them.
        """
        if not block_hashes or not self._slots:
            return {}
        rows = self._find_many(np.fromiter(block_hashes, np.uint64, len(block_hashes)))
        missing = np.flatnonzero(rows < 0)
        depth = int(missing[0]) if missing.size else len(rows)
        if depth == 0:
            return {}
        masks = np.ascontiguousarray(self._masks[rows[:depth]], dtype="<u8")
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
        runs = np.logical_and.accumulate(bits, axis=0).sum(axis=0)
        return {e: int(runs[s]) for e, s in self._slots.items() if runs[s]}

    # ------------------------------------------------------------------ the table

    def _allocate(self, bits: int) -> None:
        self._bits = bits
        self._cap = 1 << bits
        self._used = 0
        self._keys = np.zeros(self._cap, np.uint64)
        # One row per slot, plus a last row for the hash 0 (0 marks an empty key).
        self._masks = np.zeros((self._cap + 1, self._words), np.uint64)

    def _bit(self, endpoint: str) -> tuple[int, int]:
        slot = self._slots[endpoint]
        return slot // _WORD, 1 << (slot % _WORD)

    def _home(self, h: int) -> int:
        return ((h * _FIBONACCI) & _M64) >> (64 - self._bits)

    def _homes(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * np.uint64(_FIBONACCI)) >> np.uint64(64 - self._bits)).astype(np.int64)

    def _probe(self, h: int) -> int:
        """The row holding ``h`` or, when ``h`` is absent, the empty row its probe run ends at."""
        if h == 0:
            return self._cap
        keys, mask = self._keys, self._cap - 1
        i = self._home(h)
        while (k := int(keys[i])) != h and k != 0:
            i = (i + 1) & mask
        return i

    def _find(self, h: int) -> int:
        """Row of ``h``, or -1."""
        i = self._probe(h)
        return i if h == 0 or int(self._keys[i]) == h else -1

    def _row_for_insert(self, h: int) -> int:
        if h != 0 and (self._used + 1) * 3 > self._cap * 2:
            self._resize(self._bits + 1)
        i = self._probe(h)
        if h != 0 and int(self._keys[i]) == 0:
            self._keys[i] = h
            self._used += 1
        return i

    def _delete(self, hole: int) -> None:
        """Empty row ``hole``, shifting later entries of its probe run back (no tombstones)."""
        keys, masks, mask = self._keys, self._masks, self._cap - 1
        j = hole
        while True:
            j = (j + 1) & mask
            k = int(keys[j])
            if k == 0:
                break
            # The entry at j may fill the hole if the hole lies on its probe path.
            if (j - self._home(k)) & mask >= (j - hole) & mask:
                keys[hole] = k
                masks[hole] = masks[j]
                hole = j
        keys[hole] = 0
        masks[hole] = 0
        self._used -= 1

    def _find_many(self, queries: np.ndarray) -> np.ndarray:
        """Row of each query, -1 where absent (vectorised probing)."""
        rows = np.full(len(queries), -1, np.int64)
        rows[queries == 0] = self._cap
        active = np.flatnonzero(queries != 0)
        pos = self._homes(queries[active])
        mask = self._cap - 1
        while active.size:
            found = self._keys[pos]
            hit = found == queries[active]
            rows[active[hit]] = pos[hit]
            going = ~hit & (found != 0)
            active, pos = active[going], (pos[going] + 1) & mask
        return rows

    def _compact(self) -> None:
        """Drop keys no endpoint holds any more, shrinking the table if it is mostly empty."""
        occupied = np.flatnonzero(self._keys)
        kept = occupied[self._masks[occupied].any(axis=1)]
        bits = _MIN_BITS
        while len(kept) * 3 > (1 << bits) * 2:
            bits += 1
        self._rebuild(self._keys[kept], self._masks[kept], bits)

    def _resize(self, bits: int) -> None:
        occupied = np.flatnonzero(self._keys)
        self._rebuild(self._keys[occupied], self._masks[occupied], bits)

    def _rebuild(self, keys: np.ndarray, masks: np.ndarray, bits: int) -> None:
        """A fresh table of ``2**bits`` slots holding ``keys`` (distinct, non-zero) with ``masks``.

        Inserted in rounds: each key probes from its home, and in every round the keys whose
        current slot is empty claim it (one per slot); the others move one slot on.
        """
        zero_row = self._masks[self._cap].copy()
        self._allocate(bits)
        self._masks[self._cap] = zero_row
        pending = np.arange(len(keys))
        pos = self._homes(keys)
        mask = self._cap - 1
        while pending.size:
            at = pos[pending]
            free = self._keys[at] == 0
            _, first = np.unique(at[free], return_index=True)
            placed = pending[free][first]
            self._keys[pos[placed]] = keys[placed]
            self._masks[pos[placed]] = masks[placed]
            waiting = np.ones(len(pending), bool)
            waiting[np.flatnonzero(free)[first]] = False
            pending = pending[waiting]
            pos[pending] = (pos[pending] + 1) & mask
        self._used = len(keys)
