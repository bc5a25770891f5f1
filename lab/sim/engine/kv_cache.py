"""Paged KV cache with automatic prefix caching, after vLLM v1's block pool.

Facts carried over from vLLM:

- One block of the pool is reserved (vLLM's null block); usage is the fraction of the other
  blocks held by at least one request.
- A full block is registered in the prefix cache under its chained digest as soon as the step
  that fills it is scheduled (generated tokens included), so a request admitted later in the
  same step can already hit it.
- A lookup matches whole prompt blocks from the start, and never the whole sequence: the last
  token is always recomputed, so at most ``num_tokens - 1`` tokens hit (a 132-token prompt with
  32-token blocks hits 128).
- Free blocks wait in an LRU queue and keep their digest until reused. A finished request's
  blocks are queued tail first, so its last blocks are evicted first; blocks that never filled
  go to the front, as nothing can hit them. Taking a block for new tokens evicts its digest.
- Several blocks may carry the same digest (two requests computed the same block); each
  registration publishes ``BlockStored`` and each eviction ``BlockRemoved``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from epp.kvcache.block_hash import external_hash
from sim.engine.request import EngineRequest


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class KVCacheManager:
    """Blocks of one engine: allocation per request, prefix-cache lookups, and KV events.

    Request-side state lives on the request (``blocks``, ``num_cached_blocks``,
    ``block_hashes``); this class keeps the pool, the free queue and the digest map.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_usable_blocks = num_gpu_blocks - 1
        self.enable_caching = enable_caching
        self.record_events = record_events and enable_caching
        blocks = [KVBlock(block_id) for block_id in range(1, num_gpu_blocks)]
        # Front = next block to reuse (least recently used); blocks here have ref_cnt 0.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)
        self._cached: dict[bytes, list[KVBlock]] = {}
        self._events: list[dict[str, Any]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_cached_digests(self) -> int:
        return len(self._cached)

    def is_cached(self, digest: bytes) -> bool:
        return digest in self._cached

    def get_computed_blocks(self, request: EngineRequest) -> list[KVBlock]:
        """Cached blocks matching the request's leading full blocks, stopping at the first miss.

        Capped so that at least the last token is left to compute. Does not take references.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        cached = self._cached
        hits: list[KVBlock] = []
        for index in range(min(max_blocks, len(hashes))):
            holders = cached.get(hashes[index])
            if holders is None:
                break
            hits.append(holders[0])
        return hits

    def allocate_slots(
        self,
        request: EngineRequest,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        *,
        reserve_full_sequence: bool = False,
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False if too few are free.

        ``computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) adopted by a
        request that holds no blocks yet. With ``reserve_full_sequence`` the request is admitted
        only if blocks for all its current tokens are free, not just for this chunk (vLLM's
        admission rule, so a long chunked prompt does not force preemptions halfway).
        On success, blocks that the scheduled tokens fill are registered in the prefix cache.
        """
        block_size = self.block_size
        num_computed = request.num_computed_tokens + len(computed_blocks) * block_size
        num_held = len(request.blocks) + len(computed_blocks)
        num_new_blocks = max(-(-(num_computed + num_new_tokens) // block_size) - num_held, 0)
        # Hits on unreferenced blocks take them out of the free queue.
        num_needed = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if reserve_full_sequence:
            num_needed += max(-(-request.num_tokens // block_size) - num_held, num_new_blocks)
        else:
            num_needed += num_new_blocks
        if num_needed > len(self._free):
            return False

        if computed_blocks:
            for block in computed_blocks:
                if block.ref_cnt == 0:
                    del self._free[block.block_id]
                block.ref_cnt += 1
            request.blocks.extend(computed_blocks)
            request.num_cached_blocks = len(request.blocks)
        if num_new_blocks:
            take = self._take_free_block
            request.blocks.extend([take() for _ in range(num_new_blocks)])
        if self.enable_caching:
            self._cache_full_blocks(
                request, min(num_computed + num_new_tokens, request.num_tokens) // block_size
            )
        return True

    def append_block(self, request: EngineRequest) -> None:
        """Give the request one more block from the free queue (the caller checked there is one).

        Used by ``Engine.fast_forward_decode``, which replays the allocations of many decode
        steps in the order the steps would have made them.
        """
        request.blocks.append(self._take_free_block())

    def cache_full_blocks(self, request: EngineRequest, num_full_blocks: int) -> None:
        """Register the request's first ``num_full_blocks`` blocks in the prefix cache."""
        if self.enable_caching:
            self._cache_full_blocks(request, num_full_blocks)

    def free(self, request: EngineRequest) -> None:
        """Release the request's blocks (tail first into the LRU queue)."""
        free = self._free
        for block in reversed(request.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)
        request.blocks = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached digest; refused (False) while any block is held, as in vLLM."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        for block in self._free.values():
            block.block_hash = None
        if self.record_events:
            self._events.append({"type": "AllBlocksCleared"})
        return True

    def drain_events(self) -> list[dict[str, Any]]:
        """KV events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _take_free_block(self) -> KVBlock:
        block = self._free.popitem(last=False)[1]
        block.ref_cnt = 1
        digest = block.block_hash
        if digest is not None:
            holders = self._cached[digest]
            holders.remove(block)
            if not holders:
                del self._cached[digest]
            block.block_hash = None
            if self.record_events:
                self._events.append(
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [external_hash(digest)],
                        "medium": "GPU",
                        "group_idx": 0,
                    }
                )
        return block

    def _cache_full_blocks(self, request: EngineRequest, num_full_blocks: int) -> None:
        start = request.num_cached_blocks
        if num_full_blocks <= start:
            return
        blocks = request.blocks
        hashes = request.block_hashes
        cached = self._cached
        for index in range(start, num_full_blocks):
            block = blocks[index]
            digest = hashes[index]
            block.block_hash = digest
            holders = cached.get(digest)
            if holders is None:
                cached[digest] = [block]
            else:
                holders.append(block)
        request.num_cached_blocks = num_full_blocks
        if self.record_events:
            self._events.append(self._block_stored(request, start, num_full_blocks))

    def _block_stored(self, request: EngineRequest, start: int, end: int) -> dict[str, Any]:
        size = self.block_size
        salt = request.cache_salt
        return {
            "type": "BlockStored",
            "block_hashes": [external_hash(digest) for digest in request.block_hashes[start:end]],
            "parent_block_hash": external_hash(request.block_hashes[start - 1]) if start else None,
            "token_ids": request.all_token_ids[start * size : end * size],
            "block_size": size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [[salt] if index == 0 and salt else None for index in range(start, end)],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
