"""The data plugins hand each other through a request's :class:`~epp.scheduling.framework.CycleState`.

Each key is written by one producer before scheduling and read by the plugins after it (the
pipeline orders producers by these declarations, ``Plugin.produces``/``consumes``/``reads_if_present``):

=================  ===============================  ===============================================
key                written by                       read by
=================  ===============================  ===============================================
``PREFIX_MATCH``   approximate-prefix-cache-        prefix-cache-scorer, prefix-cache-affinity-
                   producer (default),              filter, kv-affinity, token-load-producer
                   precise-prefix-cache-producer    (cached tokens it books), token-load-scorer,
                                                    predicted-latency-producer, replica sync
``TOKEN_LOAD``     token-load-producer (default)    token-load-scorer, power-of-two,
                                                    session-affinity, predicted-latency-producer
``EXPECTED_OUTPUT``  token-load-producer (default)  token-load-scorer, latency-scorer
``ENDPOINT_SPEED``   endpoint-speed-producer        token-load-scorer (when present)
=================  ===============================  ===============================================

The predicted-latency producer's own keys (``LATENCY_PREDICTIONS``, ``PREDICTION_FALLBACK``,
``FEATURE_ROWS``) are declared with their value types in :mod:`epp.scheduling.predictions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.load.output_length import ExpectedOutput
from epp.load.token_load import EndpointLoad
from epp.scheduling.framework import DataKey


@dataclass(slots=True)
class PrefixMatch:
    """How much of the request's prompt each endpoint holds, in whole blocks."""

    total_blocks: int
    matched_blocks: dict[str, int] = field(default_factory=dict)
    block_hashes: list[int] = field(default_factory=list, repr=False)
    block_size_tokens: int = 0

    def fraction(self, endpoint: str) -> float:
        if self.total_blocks == 0:
            return 0.0
        return self.matched_blocks.get(endpoint, 0) / self.total_blocks

    def cached_tokens(self, endpoint: str, prompt_tokens: int) -> int:
        """Prompt tokens likely cached on ``endpoint`` (an engine always recomputes the last one)."""
        return min(self.matched_blocks.get(endpoint, 0) * self.block_size_tokens, max(0, prompt_tokens - 1))


PREFIX_MATCH: DataKey[PrefixMatch] = DataKey("prefix-cache-match")
"""How many leading prompt blocks each candidate holds."""

TOKEN_LOAD: DataKey[dict[str, EndpointLoad]] = DataKey("token-load")
"""Each candidate's booked token load (prefill, decode, KV) by endpoint name, before this request."""

ENDPOINT_SPEED: DataKey[dict[str, float]] = DataKey("endpoint-speed")
"""Each candidate's measured slowness by endpoint name: its decode step time over the pool's
typical one at the same batch (``epp.load.endpoint_speed``; 1 when not yet measured)."""

EXPECTED_OUTPUT: DataKey[ExpectedOutput] = DataKey("expected-output")
"""The request's expected output tokens and their source (``epp.load.output_length``)."""
