"""Our block hashing must name blocks exactly as vLLM does (checked against recorded events)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from epp.kvcache.block_hash import NONE_HASH, chain_hashes, external_hash, hash_block
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR

FIXTURE = Path(__file__).parent.parent / "fixtures" / "vllm-0.32" / "kv_events_sample.txt"
# The prompt whose BlockStored event vLLM 0.32 published in the fixture (block size 32).
PROMPT = "def f(x):\n    return x * 2\n" * 12


def recorded_first_event_hashes() -> list[int]:
    for line in FIXTURE.read_text().splitlines():
        if "'BlockStored'" in line and "'parent_block_hash': None" in line and "[None, None" in line:
            return ast.literal_eval(re.search(r"'block_hashes': (\[[^\]]*\])", line).group(1))
    raise AssertionError("fixture lacks the first BlockStored event")


def test_chain_matches_vllm_block_stored_event() -> None:
    tokens = ModelTokenizer(TINY_MODEL_DIR).encode(PROMPT)
    ours = [external_hash(d) for d in chain_hashes(tokens, 32)]
    assert ours == recorded_first_event_hashes()


def test_chain_is_incremental_and_ignores_partial_blocks() -> None:
    tokens = list(range(100))
    full = chain_hashes(tokens, 16)
    assert len(full) == 6
    head = chain_hashes(tokens[:48], 16)
    tail = chain_hashes(tokens, 16, parent=head[-1], start=48)
    assert head + tail == full


def test_salt_changes_every_block_after_the_first() -> None:
    tokens = list(range(64))
    plain, salted = chain_hashes(tokens, 16), chain_hashes(tokens, 16, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert hash_block(None, tokens[:16]) == hash_block(NONE_HASH, tokens[:16]) == plain[0]
