"""The block pool: prefix hits, LRU eviction, reference counts, KV events, reset."""

from __future__ import annotations

from epp.kvcache.block_hash import chain_hashes, external_hash
from sim.engine import EngineRequest, KVCacheManager

from .conftest import prompt


def hashed_request(
    request_id: str, tokens: list[int], block_size: int, salt: str | None = None
) -> EngineRequest:
    request = EngineRequest(request_id, tokens, 1, cache_salt=salt)
    request.block_hashes = chain_hashes(tokens, block_size, cache_salt=salt)
    return request


def admit(kv: KVCacheManager, request: EngineRequest) -> int:
    """Look up and allocate the whole prompt, as a first admission does; returns the hit tokens."""
    hits = kv.get_computed_blocks(request)
    num_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits, reserve_full_sequence=True)
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_hits_are_whole_blocks_and_leave_the_last_token() -> None:
    # The recorded vLLM runs: 132 tokens in blocks of 32 hit 128; 1,257 tokens hit 1,248.
    for length, expected in [(132, 128), (1257, 1248), (128, 96), (31, 0)]:
        kv = KVCacheManager(512, 32)
        tokens = prompt(length)
        first = hashed_request("a", tokens, 32)
        assert admit(kv, first) == 0
        kv.free(first)
        assert admit(kv, hashed_request("b", tokens, 32)) == expected


def test_lookup_stops_at_first_missing_block() -> None:
    kv = KVCacheManager(64, 4)
    tokens = prompt(16)
    admit(kv, hashed_request("a", tokens, 4))
    changed = [*tokens[:4], 1, *tokens[5:]]  # second block differs, so later blocks cannot match
    assert admit(kv, hashed_request("b", [*changed, 7], 4)) == 4


def test_salt_separates_caches() -> None:
    kv = KVCacheManager(64, 4)
    tokens = prompt(12)
    admit(kv, hashed_request("a", tokens, 4, salt="tenant-1"))
    assert admit(kv, hashed_request("b", [*tokens, 5], 4, salt="tenant-2")) == 0
    assert admit(kv, hashed_request("c", [*tokens, 5], 4, salt="tenant-1")) == 12


def test_freed_request_loses_its_tail_blocks_first() -> None:
    kv = KVCacheManager(9, 4, record_events=True)  # 8 usable blocks
    first = hashed_request("a", prompt(16), 4)
    admit(kv, first)
    kv.free(first)
    kv.drain_events()
    # 6 new blocks: the 4 never-used ones, then a's last two blocks.
    other = hashed_request("b", prompt(24, start=5000), 4)
    admit(kv, other)
    removed = [event["block_hashes"][0] for event in kv.drain_events() if event["type"] == "BlockRemoved"]
    assert removed == [external_hash(first.block_hashes[3]), external_hash(first.block_hashes[2])]
    kv.free(other)
    assert admit(kv, hashed_request("c", [*prompt(16), 1], 4)) == 8


def test_shared_blocks_stay_referenced_until_every_holder_frees_them() -> None:
    kv = KVCacheManager(17, 4)  # 16 usable blocks
    shared = prompt(8)
    first = hashed_request("a", shared + prompt(4, start=50), 4)
    second = hashed_request("b", shared + prompt(4, start=60), 4)
    admit(kv, first)
    assert admit(kv, second) == 8
    assert kv.num_used_blocks == 4  # two shared blocks + one private block each
    kv.free(first)
    assert kv.num_used_blocks == 3
    assert [block.ref_cnt for block in second.blocks] == [1, 1, 1]
    kv.free(second)
    assert kv.num_used_blocks == 0
    assert kv.usage == 0.0


def test_allocation_fails_without_enough_free_blocks() -> None:
    kv = KVCacheManager(5, 4)  # 4 usable blocks
    first = hashed_request("a", prompt(12), 4)
    admit(kv, first)
    second = hashed_request("b", prompt(8, start=70), 4)
    assert not kv.allocate_slots(second, 8)
    assert second.blocks == []
    assert kv.allocate_slots(second, 4)  # one block still fits
    assert kv.usage == 1.0


def test_admission_reserves_the_whole_sequence() -> None:
    kv = KVCacheManager(5, 4)  # 4 usable blocks
    admit(kv, hashed_request("a", prompt(8), 4))
    long = hashed_request("b", prompt(12, start=70), 4)
    assert kv.allocate_slots(long, 4)  # a 4-token chunk fits on its own...
    kv.free(long)
    assert not kv.allocate_slots(long, 4, reserve_full_sequence=True)  # ...the 12-token prompt does not


def test_block_stored_events_have_vllm_shape_and_digests() -> None:
    kv = KVCacheManager(64, 4, record_events=True)
    tokens = prompt(10)
    request = hashed_request("a", tokens, 4, salt="s1")
    admit(kv, request)
    (event,) = kv.drain_events()
    assert event == {
        "type": "BlockStored",
        "block_hashes": [external_hash(digest) for digest in chain_hashes(tokens, 4, cache_salt="s1")],
        "parent_block_hash": None,
        "token_ids": tokens[:8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["s1"], None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def test_blocks_filled_later_are_stored_with_their_parent() -> None:
    kv = KVCacheManager(64, 4, record_events=True)
    request = hashed_request("a", prompt(6), 4)
    admit(kv, request)
    for token in (7, 8):  # fill the second block with "generated" tokens
        request.append_output_token(token, 4)
    assert kv.allocate_slots(request, 2)
    _, second = kv.drain_events()
    assert second["block_hashes"] == [external_hash(request.block_hashes[1])]
    assert second["parent_block_hash"] == external_hash(request.block_hashes[0])
    assert second["token_ids"] == request.all_token_ids[4:8]
    assert second["extra_keys"] == [None]


def test_unfilled_blocks_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(9, 4)  # 8 usable blocks
    first = hashed_request("a", prompt(6), 4)  # one full block, one partial
    admit(kv, first)
    partial = first.blocks[1]
    kv.free(first)
    other = hashed_request("b", prompt(3, start=90), 4)
    assert kv.allocate_slots(other, 3)
    assert other.blocks == [partial]
    assert kv.is_cached(first.block_hashes[0])


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    kv = KVCacheManager(64, 4, record_events=True)
    request = hashed_request("a", prompt(8), 4)
    admit(kv, request)
    assert not kv.reset_prefix_cache()
    kv.free(request)
    kv.drain_events()
    assert kv.reset_prefix_cache()
    assert kv.drain_events() == [{"type": "AllBlocksCleared"}]
    assert kv.num_cached_digests == 0
    assert admit(kv, hashed_request("b", [*prompt(8), 1], 4)) == 0


def test_no_events_unless_recording() -> None:
    kv = KVCacheManager(64, 4)
    admit(kv, hashed_request("a", prompt(8), 4))
    assert kv.drain_events() == []


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(64, 4, enable_caching=False, record_events=True)
    tokens = prompt(8)
    first = EngineRequest("a", tokens, 1)
    admit(kv, first)
    kv.free(first)
    assert admit(kv, EngineRequest("b", [*tokens, 1], 1)) == 0
    assert kv.num_cached_digests == 0
    assert kv.drain_events() == []
