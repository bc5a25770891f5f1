"""Prefix-cache affinity from the engines' own KV events (vLLM ``BlockStored``/``BlockRemoved``).

``precise-prefix-cache-producer`` (produces ``prefix-cache-match``, like the approximate one)
  Hashes the prompt exactly as the engine does (vLLM's chained block hash: same block size,
  algorithm and seed) and looks up how many leading blocks each candidate's engine holds in
  the precise index that the data layer builds from KV events (``epp.datalayer.kv_events``).
  An endpoint without a KV-event source, or whose events went stale, is looked up instead in
  an approximate index of what this producer routed where (kept for every endpoint, as
  ``approximate-prefix-cache-producer`` keeps it, with the same hashes). ``prefix-cache-scorer``,
  ``prefix-cache-affinity-filter`` and the predicted-latency producer read the result.

  ==========================  ==============  ==============================================
  parameter                   default         meaning
  ==========================  ==============  ==============================================
  blockSizeTokens             32              the engine's ``--block-size`` (vLLM on CPU: 32)
  hashAlgo                    sha256          the engine's ``--prefix-caching-hash-algo``
                                              (``sha256`` or ``xxhash``)
  hashSeed                    vllm-none-hash  the engine's ``PYTHONHASHSEED`` if it sets one
  maxPrefixBlocksToMatch      4096            blocks considered (4096 × 32 = 131,072 tokens)
  lruCapacityPerServer        auto            approximate fallback: blocks remembered per
                                              endpoint (as ``approximate-prefix-cache-producer``)
  ==========================  ==============  ==============================================

``precise-prefix-cache-scorer``
  The producer above and ``prefix-cache-scorer`` in one plugin (as llm-d names it): same
  parameters; score = matched blocks / prompt blocks. Configure it instead of, not with, a
  prefix-cache producer.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.kvcache.block_chains import block_chains_of
from epp.kvcache.block_hash import NONE_HASH_SEED, BlockHasher, HashAlgo, external_hash
from epp.plugins.prefix_cache import (
    ApproximatePrefixCacheProducer,
    ApproximatePrefixParameters,
    prefix_scores,
)
from epp.scheduling.framework import CycleState, PluginContext, Scorer
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class PrecisePrefixParameters(ApproximatePrefixParameters):
    block_size_tokens: int = Field(default=32, ge=1, alias="blockSizeTokens")
    hash_algo: HashAlgo = Field(default="sha256", alias="hashAlgo")
    hash_seed: str = Field(default=NONE_HASH_SEED, alias="hashSeed")
    max_prefix_blocks_to_match: int = Field(default=4096, ge=1, alias="maxPrefixBlocksToMatch")


@register
class PrecisePrefixCacheProducer(ApproximatePrefixCacheProducer):
    type_name = "precise-prefix-cache-producer"
    Parameters = PrecisePrefixParameters
    params: PrecisePrefixParameters

    def __init__(self, name: str, params: PrecisePrefixParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.hasher = BlockHasher(params.hash_algo, params.hash_seed)
        self.precise = context.kv_index

    def engine_token_ids_needed(self) -> str:
        return "it matches the prompt's blocks against the engines' KV events"

    def block_hashes(self, request: LLMRequest) -> list[int]:
        """The prompt's blocks as the engine names them (those of a cached prefix reused)."""
        size, tokens = self.params.block_size_tokens, request.prompt_token_ids
        blocks = min(len(tokens) // size, self.params.max_prefix_blocks_to_match)
        chains = block_chains_of(tokens)
        # Remembered as (digest, published hash) pairs: the digest is the next block's parent.
        key = ("vllm", self.hasher.algo, self.hasher.seed, size, request.cache_salt)
        known = chains.known(key, size)[:blocks] if chains else []
        digests = self.hasher.chain(
            tokens,
            size,
            parent=known[-1][0] if known else None,
            start=len(known) * size,
            stop=blocks * size,
            cache_salt=request.cache_salt,
        )
        pairs = [*known, *((d, external_hash(d)) for d in digests)]
        if chains:
            chains.remember(key, pairs)
        return [h for _, h in pairs]

    def matched_blocks(self, hashes: list[int], endpoints: Sequence[EndpointState]) -> dict[str, int]:
        index = self.precise
        precise = index.longest_prefix(hashes) if index is not None else {}
        approximate = self.index.longest_prefix(hashes)
        matched = {}
        for e in endpoints:
            source = precise if index is not None and index.is_live(e.name) else approximate
            if blocks := source.get(e.name, 0):
                matched[e.name] = blocks
        return matched


@register
class PrecisePrefixCacheScorer(PrecisePrefixCacheProducer, Scorer):
    type_name = "precise-prefix-cache-scorer"

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return prefix_scores(endpoints, state)
