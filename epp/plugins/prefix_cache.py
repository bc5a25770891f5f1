"""Prefix-cache affinity from the EPP's own routing history (no engine feedback needed).

``approximate-prefix-cache-producer`` (default producer of ``prefix-cache-match``)
  Hashes the prompt into token blocks, looks up how many leading blocks each candidate was
  already sent, and after the pick records the prompt's blocks for the chosen endpoint.

  ==========================  =======  ==================================================
  parameter                   default  meaning
  ==========================  =======  ==================================================
  blockSizeTokens             64       tokens per hashed block (at least 16)
  maxPrefixBlocksToMatch      2048     blocks considered (2048 × 64 = 131,072 tokens)
  lruCapacityPerServer        auto     blocks remembered per endpoint; ``auto`` sizes it
                                       from the engine's ``vllm:cache_config_info``
                                       (num_gpu_blocks × block_size tokens; looked at
                                       once a second), else 31,250
  ==========================  =======  ==================================================

``prefix-cache-scorer``
  Score = matched blocks / prompt blocks. No parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, runtime_checkable

from pydantic import Field

from epp.kvcache.approximate_index import ApproximatePrefixIndex, prefix_block_hashes
from epp.kvcache.block_chains import block_chains_of
from epp.scheduling.cycle_data import PREFIX_MATCH, PrefixMatch
from epp.scheduling.framework import (
    CycleState,
    DataProducer,
    Plugin,
    PluginContext,
    PluginParameters,
    PreRequest,
    Scorer,
)
from epp.scheduling.registry import register, register_default_producer
from epp.scheduling.types import EndpointState, LLMRequest, SchedulingResult

DEFAULT_LRU_BLOCKS = 31_250
CAPACITY_REFRESH_S = 1.0


class ApproximatePrefixParameters(PluginParameters):
    block_size_tokens: int = Field(default=64, ge=16, alias="blockSizeTokens")
    max_prefix_blocks_to_match: int = Field(default=2048, ge=1, alias="maxPrefixBlocksToMatch")
    lru_capacity_per_server: int | Literal["auto"] = Field(default="auto", alias="lruCapacityPerServer")


@register_default_producer
class ApproximatePrefixCacheProducer(DataProducer, PreRequest):
    type_name = "approximate-prefix-cache-producer"
    Parameters = ApproximatePrefixParameters
    produces = (PREFIX_MATCH,)
    params: ApproximatePrefixParameters

    def __init__(self, name: str, params: ApproximatePrefixParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.index = ApproximatePrefixIndex()
        self._capacity: dict[str, int] = {}
        self._capacity_due = -math.inf

    def produce(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None:
        hashes = self.block_hashes(request)
        now = self.context.clock()
        if now >= self._capacity_due or len(self._capacity) < len(endpoints):
            # An engine's KV size is scraped once and rarely changes: worked out per endpoint
            # once a second, not per request.
            self._capacity_due = now + CAPACITY_REFRESH_S
            for e in endpoints:
                self._capacity[e.name] = self._capacity_for(e)
        matched = self.matched_blocks(hashes, endpoints)
        state.put(PREFIX_MATCH, PrefixMatch(len(hashes), matched, hashes, self.params.block_size_tokens))

    def block_hashes(self, request: LLMRequest) -> list[int]:
        """The chain of hashes naming the prompt's full blocks (those of a cached prefix reused)."""
        size, seed_text = self.params.block_size_tokens, f"{request.model}\x00{request.cache_salt or ''}"
        chains = block_chains_of(request.prompt_token_ids)
        key = ("approximate", size, seed_text)
        hashes = prefix_block_hashes(
            request.prompt_token_ids,
            size,
            seed_text=seed_text,
            max_blocks=self.params.max_prefix_blocks_to_match,
            known=chains.known(key, size) if chains else (),
        )
        if chains:
            chains.remember(key, hashes)
        return hashes

    def matched_blocks(self, hashes: list[int], endpoints: Sequence[EndpointState]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each endpoint holds (0s may be omitted)."""
        return self.index.longest_prefix(hashes)

    def _capacity_for(self, endpoint: EndpointState) -> int:
        configured = self.params.lru_capacity_per_server
        if configured != "auto":
            return configured
        m = endpoint.metrics
        if m.num_gpu_blocks and m.block_size:
            return max(1, m.num_gpu_blocks * m.block_size // self.params.block_size_tokens)
        return DEFAULT_LRU_BLOCKS

    def pre_request(self, request: LLMRequest, result: SchedulingResult, state: CycleState) -> None:
        match = state.get(PREFIX_MATCH)
        if match is None or not match.block_hashes:
            return
        self.record(result.endpoint.name, match.block_hashes)

    def record(self, endpoint: str, block_hashes: list[int]) -> None:
        """Note that ``endpoint`` was sent these blocks (this replica's pick, or a peer's)."""
        self.index.record(endpoint, block_hashes, self._capacity.get(endpoint, DEFAULT_LRU_BLOCKS))

    @property
    def block_size_tokens(self) -> int:
        return self.params.block_size_tokens


@runtime_checkable
class IndexesPrefixes(Protocol):
    """A plugin that keeps where prompts' prefix blocks were sent, per endpoint (``index``, of
    blocks of ``block_size_tokens``): the approximate and precise prefix-cache producers."""

    index: ApproximatePrefixIndex

    @property
    def block_size_tokens(self) -> int: ...

    def block_hashes(self, request: LLMRequest) -> list[int]:
        """The chain of hashes naming the prompt's full blocks."""
        ...

    def record(self, endpoint: str, block_hashes: list[int]) -> None:
        """Note that ``endpoint`` was sent these blocks."""
        ...


def find_prefix_index(plugins: Iterable[Plugin]) -> IndexesPrefixes | None:
    """The plugin among ``plugins`` that indexes prefixes, if there is one."""
    return next((p for p in plugins if isinstance(p, IndexesPrefixes)), None)


@register
class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"
    consumes = (PREFIX_MATCH,)

    def score(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[float]:
        return prefix_scores(endpoints, state)


def prefix_scores(endpoints: Sequence[EndpointState], state: CycleState) -> list[float]:
    """Each endpoint's share of the prompt's blocks that it holds (0 without a prefix match)."""
    match = state.get(PREFIX_MATCH)
    if match is None:
        return [0.0] * len(endpoints)
    return [match.fraction(e.name) for e in endpoints]
