"""Pickers: turn weighted scores into a ranked list of targets.

All pickers take one parameter, ``maxNumOfEndpoints`` (default 1): how many endpoints to
return, the first being the target and the rest fallbacks for the proxy.

``max-score-picker``       highest score first; ties broken at random.
``random-picker``          uniform random order, scores ignored.
``weighted-random-picker`` random order weighted by score (A-Res: key = U^(1/score), largest
                           first), so an endpoint is picked with probability ∝ its score;
                           falls back to uniform when every score is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from epp.scheduling.framework import Picker, PluginParameters, ScoredEndpoint
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class PickerParameters(PluginParameters):
    max_num_of_endpoints: int = Field(default=1, ge=1, alias="maxNumOfEndpoints")


class _RankingPicker(Picker):
    Parameters = PickerParameters
    params: PickerParameters

    def _keys(self, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        raise NotImplementedError

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[EndpointState]:
        keys = self._keys(scored)
        order = sorted(range(len(scored)), key=keys.__getitem__, reverse=True)
        return [scored[i].state for i in order[: self.params.max_num_of_endpoints]]


@register
class MaxScorePicker(_RankingPicker):
    type_name = "max-score-picker"

    def _keys(self, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        return [(s.score, rng.random()) for s in scored]


@register
class RandomPicker(_RankingPicker):
    type_name = "random-picker"

    def _keys(self, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        return [(rng.random(), 0.0) for _ in scored]


@register
class WeightedRandomPicker(_RankingPicker):
    type_name = "weighted-random-picker"

    def _keys(self, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        if all(s.score <= 0 for s in scored):
            return [(rng.random(), 0.0) for _ in scored]
        # Zero-score endpoints rank after every positive one, in random order among themselves.
        return [
            (rng.random() ** (1.0 / s.score), 1.0) if s.score > 0 else (-1.0, rng.random()) for s in scored
        ]
