"""vLLM's prefix-cache block hashing, reproduced bit for bit.

vLLM (v1, ``--prefix-caching-hash-algo sha256``) names each full block of ``block_size``
tokens by a hash chained over every block before it::

    NONE_HASH = sha256(pickle("vllm-none-hash"))
    hash_i    = sha256(pickle((hash_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i)))

with pickle protocol 5. ``extra_keys`` is ``None`` for plain text, and
``(("cache_salt", salt),)`` on the first block of a salted request. KV events publish the
low 64 bits of each digest as an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default). Checked against vLLM 0.32's ``BlockStored`` events.

The simulator's engine and the EPP's prefix indexes both hash with this module, so a
prompt routed by the EPP names the same blocks the engine caches.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

_PICKLE_PROTOCOL = 5
NONE_HASH_SEED = "vllm-none-hash"
NONE_HASH: bytes = hashlib.sha256(pickle.dumps(NONE_HASH_SEED, protocol=_PICKLE_PROTOCOL)).digest()
_LOW_64 = (1 << 64) - 1


def hash_block(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """Return the 32-byte digest naming one full block whose predecessor hashed to ``parent``."""
    payload = (parent or NONE_HASH, tuple(tokens), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=_PICKLE_PROTOCOL)).digest()


def external_hash(digest: bytes) -> int:
    """The 64-bit int form of a block digest that vLLM publishes in KV events."""
    return int.from_bytes(digest, "big") & _LOW_64


def first_block_extra_keys(cache_salt: str | None) -> tuple | None:
    return (("cache_salt", cache_salt),) if cache_salt else None


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    start: int = 0,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Digests of the full blocks of ``tokens[start:]``, chained from ``parent``.

    ``start`` must be a multiple of ``block_size``; a trailing partial block is not hashed.
    Pass the last digest already known as ``parent`` to extend a chain incrementally.
    """
    if start % block_size:
        raise ValueError(f"start {start} is not a multiple of block_size {block_size}")
    digests: list[bytes] = []
    for begin in range(start, len(tokens) - block_size + 1, block_size):
        extra = first_block_extra_keys(cache_salt) if begin == 0 else None
        parent = hash_block(parent, tokens[begin : begin + block_size], extra)
        digests.append(parent)
    return digests
