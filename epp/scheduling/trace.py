"""What one scheduling cycle did, step by step: the raw material of the decision trace.

:meth:`SchedulingProfile.run` records, in the cycle state under :data:`SCHEDULING_TRACE`, the
candidates each filter removed, each scorer's weighted scores, and the picker's ranking. It
records names and numbers only (no request content), so the trace may leave the process in a
response header, a span or a log line (``epp.observability.decision``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.scheduling.framework import DataKey


@dataclass(frozen=True, slots=True)
class ScorerStep:
    """One scorer's contribution: ``weight`` × its score, per endpoint, in candidate order."""

    scorer: str
    weight: float
    weighted: tuple[float, ...]


@dataclass(slots=True)
class SchedulingTrace:
    candidates: tuple[str, ...]
    """Every endpoint the profile started with (the candidate sampler's sample, if any)."""
    sampled_from: int | None = None
    """The pool's size, when a candidate sampler narrowed it to ``candidates``."""
    removed: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    """(filter, the endpoints it removed), in filter order."""
    scored: tuple[str, ...] = ()
    """The endpoints left after the filters, in the order of each ``ScorerStep.weighted``."""
    scorers: list[ScorerStep] = field(default_factory=list)
    ranking: tuple[str, ...] = ()
    """The picker's order: the target first, then the fallbacks."""


SCHEDULING_TRACE: DataKey[SchedulingTrace] = DataKey("scheduling-trace")
