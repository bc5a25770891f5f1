"""vLLM's prefix-cache block hashing, reproduced bit for bit.

vLLM (v1) names each full block of ``block_size`` tokens by a hash chained over every block
before it::

    NONE_HASH = H(pickle(seed))
    hash_i    = H(pickle((hash_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i)))

with pickle protocol 5, ``H`` the ``--prefix-caching-hash-algo`` (``sha256``, the default:
SHA-256; ``xxhash``: XXH3-128) and ``seed`` ``$PYTHONHASHSEED`` when the engine has it set,
else ``"vllm-none-hash"`` (for ``xxhash`` without ``PYTHONHASHSEED`` vLLM draws a random seed:
such an engine's hashes cannot be reproduced). ``extra_keys`` is ``None`` for plain text, and
``(("cache_salt", salt),)`` on the first block of a salted request. KV events publish the low
64 bits of each digest as an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by
default). Checked against vLLM 0.32's ``BlockStored`` events and its own hash functions. The
``*_cbor`` algorithms are not supported.

The simulator's engine and the EPP's prefix indexes both hash with this module, so a
prompt routed by the EPP names the same blocks the engine caches.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import xxhash

_PICKLE_PROTOCOL = 5
NONE_HASH_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1
HashAlgo = Literal["sha256", "xxhash"]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS = {"sha256": _sha256, "xxhash": xxhash.xxh3_128_digest}


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """One engine's block hashing: its hash algorithm and NONE_HASH seed."""

    algo: HashAlgo = "sha256"
    seed: str = NONE_HASH_SEED
    none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "none_hash", self._digest(self.seed))

    def _digest(self, payload: object) -> bytes:
        return _DIGESTS[self.algo](pickle.dumps(payload, protocol=_PICKLE_PROTOCOL))

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None
    ) -> bytes:
        """The digest naming one full block whose predecessor hashed to ``parent``."""
        return self._digest((parent or self.none_hash, tuple(tokens), extra_keys))

    def chain(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        parent: bytes | None = None,
        start: int = 0,
        stop: int | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """Digests of the full blocks of ``tokens[start:stop]``, chained from ``parent``.

        ``start`` must be a multiple of ``block_size``; a trailing partial block is not hashed.
        Pass the last digest already known as ``parent`` to extend a chain incrementally.
        """
        if start % block_size:
            raise ValueError(f"start {start} is not a multiple of block_size {block_size}")
        end = len(tokens) if stop is None else min(stop, len(tokens))
        digests: list[bytes] = []
        for begin in range(start, end - block_size + 1, block_size):
            extra = first_block_extra_keys(cache_salt) if begin == 0 else None
            parent = self.hash_block(parent, tokens[begin : begin + block_size], extra)
            digests.append(parent)
        return digests

    def external_chain(
        self, tokens: Sequence[int], block_size: int, *, cache_salt: str | None = None
    ) -> list[int]:
        """The chain as KV events name it: :func:`external_hash` of each digest."""
        return [external_hash(d) for d in self.chain(tokens, block_size, cache_salt=cache_salt)]


def external_hash(digest: bytes) -> int:
    """The 64-bit int form of a block digest that vLLM publishes in KV events."""
    return int.from_bytes(digest, "big") & _LOW_64


def first_block_extra_keys(cache_salt: str | None) -> tuple | None:
    return (("cache_salt", cache_salt),) if cache_salt else None


VLLM_DEFAULT = BlockHasher()
NONE_HASH: bytes = VLLM_DEFAULT.none_hash
hash_block = VLLM_DEFAULT.hash_block
chain_hashes = VLLM_DEFAULT.chain
