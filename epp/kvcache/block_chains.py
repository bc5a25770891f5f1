"""Block-hash chains remembered with a prompt's token ids, so a longer prompt hashes only its new blocks.

Every block hash the EPP computes is chained: block *i*'s hash covers blocks 0..i. A prompt that
shares its first *n* tokens with an earlier one therefore shares the first ``n // block_size``
hashes of every chain. The tokenizer cache (``epp.tokenizer.cache``) hands out the ids of each
prompt as :class:`TokenIds`, carrying :class:`BlockChains`: the chains of the cached prompt it
extends, and where to keep this prompt's own. A producer asks for what is known, hashes the rest,
and remembers the result::

    known = chains.known(key, block_size)   # hashes of the leading blocks, maybe none
    chain = known + hash_blocks(tokens, start=len(known) * block_size, parent=known[-1] ...)
    chains.remember(key, chain)

``key`` names the chain's whole configuration (hash function, block size, seed, model, salt):
two chains with one key must give equal hashes for equal tokens. Chains are shared lists: never
mutate one, build a new list.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

Chains = dict[Hashable, list[Any]]
# An upper estimate of one block's memory in a chain (a precise (digest, hash) pair is ~170 bytes).
CHAIN_BLOCK_BYTES = 170


class BlockChains:
    """The chains known for one prompt's tokens: inherited ones, valid for its first
    ``shared_tokens`` tokens, and its own (None: this prompt's chains are not kept)."""

    __slots__ = ("_grew", "_inherited", "_own", "_shared_tokens")

    def __init__(
        self,
        inherited: Chains | None,
        shared_tokens: int,
        own: Chains | None,
        grew: Callable[[int], None] | None = None,
    ) -> None:
        self._inherited = inherited
        self._shared_tokens = shared_tokens
        self._own = own
        self._grew = grew

    def known(self, key: Hashable, block_size: int) -> list[Any]:
        """The leading block hashes of this prompt under ``key`` already computed (maybe none)."""
        if self._own is not None and (chain := self._own.get(key)) is not None:
            return chain
        if self._inherited is None or (chain := self._inherited.get(key)) is None:
            return []
        blocks = self._shared_tokens // block_size
        return chain if len(chain) <= blocks else chain[:blocks]

    def remember(self, key: Hashable, chain: list[Any]) -> None:
        """Keep ``chain`` (this prompt's leading block hashes under ``key``) for later prompts."""
        if self._own is None:
            return
        kept = self._own.get(key)
        if kept is not None and len(kept) >= len(chain):
            return
        self._own[key] = chain
        if self._grew is not None:
            self._grew((len(chain) - (len(kept) if kept else 0)) * CHAIN_BLOCK_BYTES)


class TokenIds(list[int]):
    """A prompt's token ids, as a plain list, with the block chains known for them."""

    __slots__ = ("block_chains",)

    def __init__(self, ids: Iterable[int] = (), block_chains: BlockChains | None = None) -> None:
        super().__init__(ids)
        self.block_chains = block_chains


def block_chains_of(token_ids: Iterable[int]) -> BlockChains | None:
    """The chains that came with ``token_ids`` from the tokenizer cache, if they did."""
    return token_ids.block_chains if isinstance(token_ids, TokenIds) else None
