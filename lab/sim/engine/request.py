"""One generation request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epp.kvcache.block_hash import first_block_extra_keys, hash_block

if TYPE_CHECKING:
    from sim.engine.kv_cache import KVBlock


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED}
)

FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}
"""OpenAI/vLLM ``finish_reason`` of each finished status."""


class EngineRequest:
    """A request and the engine's progress on it.

    The caller fills the constructor arguments; the engine fills the rest. ``max_output_tokens``
    is exact: the request generates that many tokens unless ``stop_after_tokens`` (the simulated
    model emitting EOS) ends it earlier with status ``FINISHED_STOPPED``. Generated tokens are
    drawn from ``random.Random(seed)``, or from a generator seeded with the request id when
    ``seed`` is None, so equal inputs give equal outputs.

    ``block_hashes`` names every full block of ``all_token_ids`` (vLLM's chained sha256, see
    ``epp.kvcache.block_hash``). The engine computes the prompt's digests once, at
    ``Engine.add_request``, unless the caller passes them as ``prompt_block_hashes`` (e.g. the
    router already hashed the prompt with the same block size and salt); digests of generated
    blocks are added as the blocks fill.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "blocks",
        "cache_salt",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "max_output_tokens",
        "num_cache_creation_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "queued_time",
        "request_id",
        "rng",
        "seed",
        "status",
        "stop_after_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_output_tokens: int,
        *,
        cache_salt: str | None = None,
        seed: int | None = None,
        arrival_time: float | None = None,
        stop_after_tokens: int | None = None,
        prompt_block_hashes: list[bytes] | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.max_output_tokens = max_output_tokens
        self.cache_salt = cache_salt
        self.seed = seed
        self.arrival_time = arrival_time
        """When the request reached the server; ``Engine.add_request`` sets it if None."""
        self.stop_after_tokens = stop_after_tokens
        self.block_hashes: list[bytes] = list(prompt_block_hashes) if prompt_block_hashes is not None else []

        self.queued_time: float | None = None
        """When the scheduler took it in: the start of the first ``Engine.schedule`` after
        ``Engine.add_request`` (vLLM's ``QUEUED`` event)."""
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache when first scheduled; -1 before that."""
        self.num_cache_creation_tokens = 0
        """Prompt tokens this request added to the prefix cache (vLLM's ``created_cache_tokens``)."""
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.rng = random.Random(seed if seed is not None else request_id)

        # KV-cache bookkeeping, owned by KVCacheManager.
        self.blocks: list[KVBlock] = []
        self.num_cached_blocks = 0
        """How many of ``blocks`` are registered in the prefix cache."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int, block_size: int | None) -> None:
        """Append a generated token; hash the block it completes when ``block_size`` is given."""
        self.output_token_ids.append(token_id)
        tokens = self.all_token_ids
        tokens.append(token_id)
        if block_size is not None and len(tokens) % block_size == 0:
            start = len(tokens) - block_size
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = first_block_extra_keys(self.cache_salt) if start == 0 else None
            self.block_hashes.append(hash_block(parent, tokens[start:], extra))

    def __repr__(self) -> str:
        return (
            f"EngineRequest({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, output={self.num_output_tokens}/{self.max_output_tokens})"
        )
