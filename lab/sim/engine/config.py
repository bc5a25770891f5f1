"""Engine limits: batch size, token budget, KV-cache geometry, context length."""

from __future__ import annotations

from dataclasses import dataclass, fields


class EngineConfigError(ValueError):
    """An engine setting is out of range."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits of one simulated vLLM engine (vLLM v1 names and meanings).

    ``num_gpu_blocks`` counts every KV block, as vLLM reports it in ``cache_config_info``; one of
    them is held back the way vLLM reserves its null block, so ``num_gpu_blocks - 1`` blocks hold
    tokens. Chunked prefill is always on: a prompt longer than the token budget is computed over
    several steps.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 27_000
    max_model_len: int = 32_768
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    """Record BlockStored/BlockRemoved/AllBlocksCleared events for ``Engine.drain_kv_events``."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(field.default, bool):
                if not isinstance(value, bool):
                    raise EngineConfigError(f"{field.name} must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{field.name} must be a positive integer, got {value!r}")
        if self.num_gpu_blocks < 2:
            raise EngineConfigError("num_gpu_blocks must be at least 2 (one block is reserved)")

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache can hold at once."""
        return self.num_usable_blocks * self.block_size
