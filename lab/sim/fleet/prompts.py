"""Token ids for simulated prompts, with shared prefixes that are real token for token.

Every piece of a prompt is generated from an integer key (a hash block id, a session turn), so
the same key always gives the same tokens and different keys practically never collide. The
engine names KV blocks by vLLM's chained sha256 (``epp.kvcache.block_hash``), which costs about
a microsecond per 16-token block: a 12k-token prompt costs ~1 ms. The builder hands the engine
the digests with the tokens, computed once per shared piece: a hash block's digests are
remembered under (parent digest, block id), and a session's next turn reuses the digests the
engine computed for the previous one.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from epp.kvcache.block_hash import chain_hashes

VOCAB_LOW, VOCAB_HIGH = 1_000, 120_000
"""Token ids used: plain-text ids of a ~128k-token vocabulary, clear of special tokens."""
OUTPUT_VOCAB = range(VOCAB_LOW, VOCAB_HIGH)
"""What simulated engines generate from."""
_DIGEST = 32
_BLOCK_SALT = 0x5EED_B10C_0000_0000
_U64 = np.uint64


def splitmix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = values + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def synthetic_tokens(key: int, count: int) -> np.ndarray:
    """``count`` token ids determined by ``key`` alone (int64)."""
    return synthetic_blocks([key], count)[0]


def synthetic_blocks(keys: Sequence[int], count: int) -> np.ndarray:
    """One row of ``count`` token ids per key, row i what ``synthetic_tokens(keys[i], count)`` gives."""
    seeds = splitmix(np.array([key & 0xFFFF_FFFF_FFFF_FFFF for key in keys], dtype=np.uint64))
    positions = np.arange(count, dtype=np.uint64) * _U64(0x9E3779B97F4A7C15)
    mixed = splitmix(seeds[:, None] + positions[None, :])
    return (mixed % _U64(VOCAB_HIGH - VOCAB_LOW)).astype(np.int64) + VOCAB_LOW


def turn_key(session_id: str, turn: int) -> int:
    """The key of the fresh tokens of one turn of one session."""
    return (zlib.crc32(session_id.encode()) << 24) | turn


class PromptBuilder:
    """Builds (token ids, engine block digests) for prompts, for engines of ``block_size``."""

    def __init__(self, block_size: int, hash_block_tokens: int, memo_limit: int = 50_000) -> None:
        self.block_size = block_size
        self.hash_block_tokens = hash_block_tokens
        self.memo_limit = memo_limit
        self._memo: dict[tuple[bytes | None, int], bytes] = {}
        self._aligned = hash_block_tokens % block_size == 0

    def fresh(self, key: int, input_tokens: int) -> tuple[list[int], list[bytes]]:
        tokens = synthetic_tokens(key, input_tokens).tolist()
        return tokens, chain_hashes(tokens, self.block_size)

    def extend(
        self, previous: np.ndarray, previous_digests: Sequence[bytes], key: int, input_tokens: int
    ) -> tuple[list[int], list[bytes]]:
        """``previous`` (a whole earlier sequence) then fresh tokens, ``input_tokens`` in all."""
        shared = min(len(previous), input_tokens)
        tokens = np.concatenate([previous[:shared], synthetic_tokens(key, input_tokens - shared)]).tolist()
        reuse = min(shared // self.block_size, len(previous_digests))
        digests = list(previous_digests[:reuse])
        digests += chain_hashes(
            tokens, self.block_size, parent=digests[-1] if digests else None, start=reuse * self.block_size
        )
        return tokens, digests

    def blocks(self, hash_ids: Sequence[int], input_tokens: int) -> tuple[list[int], list[bytes]]:
        """The blocks named by ``hash_ids``, cut to ``input_tokens``."""
        size = self.hash_block_tokens
        if not hash_ids or input_tokens > len(hash_ids) * size:
            raise ValueError(f"{len(hash_ids)} hash blocks of {size} cannot hold {input_tokens} tokens")
        pieces = synthetic_blocks([hid ^ _BLOCK_SALT for hid in hash_ids], size)
        tokens = pieces.reshape(-1)[:input_tokens].tolist()
        if not self._aligned:
            return tokens, chain_hashes(tokens, self.block_size)
        per_block = size // self.block_size
        digests: list[bytes] = []
        parent: bytes | None = None
        for hid, piece, start in zip(hash_ids, pieces, range(0, input_tokens, size), strict=False):
            whole = min(size, input_tokens - start) // self.block_size
            if whole == 0:
                break
            joined = self._memo.get((parent, hid))
            if joined is None:
                block = tokens[start : start + size] if whole == per_block else piece.tolist()
                joined = b"".join(chain_hashes(block, self.block_size, parent=parent))
                self._remember((parent, hid), joined)
            digests.extend(joined[i * _DIGEST : (i + 1) * _DIGEST] for i in range(whole))
            if whole < per_block:
                break
            parent = digests[-1]
        return tokens, digests

    def _remember(self, key: tuple[bytes | None, int], joined: bytes) -> None:
        memo = self._memo
        if len(memo) >= self.memo_limit:
            for stale in list(memo)[: self.memo_limit // 2]:
                del memo[stale]
        memo[key] = joined
