"""The InferenceObjective priorities of the pool: published by its source, read by request parsing.

Only the Kubernetes source publishes (a file-fed pool has no objectives, so none are known);
readers get a read-only mapping whose contents are the last published set, replaced whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType


class ObjectivePriorities(Mapping[str, int]):
    """Objective name → priority (below 0: sheddable), as last published."""

    def __init__(self) -> None:
        self._current: Mapping[str, int] = MappingProxyType({})

    def publish(self, priorities: Mapping[str, int]) -> None:
        """Replace the whole set (readers never see a half-updated one)."""
        self._current = MappingProxyType(dict(priorities))

    def __getitem__(self, name: str) -> int:
        return self._current[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current)

    def __len__(self) -> int:
        return len(self._current)
