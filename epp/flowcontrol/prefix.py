"""How much of a held request's prompt each endpoint likely has cached, before the pick.

A detector that limits the prompt tokens an endpoint may have waiting for their first token
must know what a request would add there: its uncached tokens, which differ per endpoint (an
agentic session's tenth turn is mostly cached where its ninth ran, and all to prefill
elsewhere). :class:`PrefixEstimate` reads the pipeline's ``approximate-prefix-cache-producer``
index, the one its pick consults, at each dispatch attempt.
"""

from __future__ import annotations

from collections.abc import Iterable

from epp.flowcontrol.types import FlowRequest
from epp.plugins.prefix_cache import IndexesPrefixes, find_prefix_index
from epp.scheduling.cycle_data import PrefixMatch
from epp.scheduling.framework import Plugin
from epp.scheduling.types import LLMRequest


class PrefixEstimate:
    def __init__(self, producer: IndexesPrefixes) -> None:
        self.producer = producer

    @classmethod
    def of(cls, plugins: Iterable[Plugin]) -> PrefixEstimate | None:
        """The estimate from the plugin among ``plugins`` that indexes prefixes (None: there is none)."""
        producer = find_prefix_index(plugins)
        return None if producer is None else cls(producer)

    def block_hashes(self, request: LLMRequest) -> list[int]:
        """``request``'s prefix blocks (hashed once: the pick reuses them)."""
        return self.producer.block_hashes(request)

    def cached_tokens(self, request: FlowRequest) -> dict[str, int]:
        """Per endpoint holding some of it, the prompt tokens of ``request`` likely cached there
        now, counted as the pick's prefix match counts them."""
        match = PrefixMatch(
            len(request.block_hashes),
            self.producer.index.longest_prefix(request.block_hashes),
            block_size_tokens=self.producer.block_size_tokens,
        )
        return {name: match.cached_tokens(name, request.prompt_tokens) for name in match.matched_blocks}
