"""Pickers: turn weighted scores into a ranked list of targets.

All pickers take ``maxNumOfEndpoints`` (default 3): how many endpoints to return, the first
being the target and the rest fallbacks for the proxy. The gateway retries a request that got
no response byte on the next fallback (the local Envoy up to twice), so the default lists the
target and two retries in the router's own order instead of leaving retries to round-robin.

``max-score-picker``       highest score first; ties broken at random, or, on an EPP that runs as
                           one of several synced replicas (``epp.sync``), by a hash of the
                           prompt (parameter ``replicaTieBreak``, below).
``random-picker``          uniform random order, scores ignored.
``weighted-random-picker`` random order weighted by score (A-Res: key = U^(1/score), largest
                           first), so an endpoint is picked with probability ∝ its score;
                           falls back to uniform when every score is 0.
``softmax-picker``         samples by softmax over min-max normalised scores, as the Dynamo KV
                           router does over costs: p_i ∝ exp(−(s_max − s_i)/((s_max − s_min)·T)).
                           Parameter ``temperature`` T (default 0: highest score, ties at
                           random). The order is a Plackett–Luce sample (Gumbel keys), so
                           fallbacks follow the same distribution.
``round-robin``            candidates in name order, starting one further along each request;
                           scores ignored.

``replicaTieBreak`` (``max-score-picker``): ``prompt-hash`` (default) or ``random``. Synced
replicas see each other's picks only a sync lag later, so in a burst they all read the same
state. Breaking ties at random, each replica then splits what one router would have kept
together: identical prompts, such as one RL step's rollouts, end up on several endpoints, and
so do their prefix caches. With ``prompt-hash`` a tie goes to the endpoint ranked highest by a
rendezvous hash of the prompt's fingerprint (its length and its first and last 64 token ids)
and the endpoint's name. That hash is the same in every replica, so replicas that see the same
state agree on identical prompts, where one router would follow the first pick's prefix, and
spread different prompts as a random pick would. An EPP without replica sync, or one that hears
no live peer, breaks ties at random, so a single EPP routes exactly as before.

=================  ===========  ==================================================================
parameter          default      meaning
=================  ===========  ==================================================================
maxNumOfEndpoints  3            endpoints returned: the target, then the fallbacks
temperature        0            ``softmax-picker``: T above; 0 picks the highest score
replicaTieBreak    prompt-hash  ``max-score-picker``: ``prompt-hash`` or ``random`` (above)
=================  ===========  ==================================================================
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from epp.scheduling.framework import Picker, PluginContext, PluginParameters, ScoredEndpoint
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class PickerParameters(PluginParameters):
    max_num_of_endpoints: int = Field(default=3, ge=1, alias="maxNumOfEndpoints")


class MaxScorePickerParameters(PickerParameters):
    replica_tie_break: Literal["prompt-hash", "random"] = Field(
        default="prompt-hash", alias="replicaTieBreak"
    )


class SoftmaxPickerParameters(PickerParameters):
    temperature: float = Field(default=0.0, ge=0.0, le=1000.0)


class _RankingPicker(Picker):
    Parameters = PickerParameters
    params: PickerParameters

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        raise NotImplementedError

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[EndpointState]:
        keys = self._keys(request, scored)
        order = sorted(range(len(scored)), key=keys.__getitem__, reverse=True)
        return [scored[i].state for i in order[: self.params.max_num_of_endpoints]]


@register
class MaxScorePicker(_RankingPicker):
    type_name = "max-score-picker"
    Parameters = MaxScorePickerParameters
    params: MaxScorePickerParameters

    def __init__(self, name: str, params: MaxScorePickerParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._live_peers: Callable[[], int] | None = None

    def join_replicas(self, live_peers: Callable[[], int]) -> None:
        """This EPP syncs with peer replicas (``epp.sync.hook`` calls this): whenever
        ``live_peers()`` says some are alive, ties are broken as ``replicaTieBreak`` says."""
        self._live_peers = live_peers if self.params.replica_tie_break == "prompt-hash" else None

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        # A request with no prompt (a /v1/models call) has nothing to agree on: hashing it would
        # send every such tie to one endpoint.
        if self._live_peers is not None and request.prompt_token_ids and self._live_peers():
            fingerprint = prompt_fingerprint(request.prompt_token_ids)
            return [(s.score, rendezvous_rank(fingerprint, s.state.name)) for s in scored]
        rng = self.context.rng
        return [(s.score, rng.random()) for s in scored]


FINGERPRINT_TOKENS = 64
"""Token ids taken from each end of the prompt for its fingerprint."""


def prompt_fingerprint(token_ids: Sequence[int]) -> bytes:
    """16 bytes that are equal for equal prompts, the same in every process and on every machine
    (no per-process hash seed): a hash of the prompt's length and of its first and last
    ``FINGERPRINT_TOKENS`` token ids, so it costs the same for any prompt length."""
    head, tail = token_ids[:FINGERPRINT_TOKENS], token_ids[-FINGERPRINT_TOKENS:]
    packed = struct.pack(f"<{1 + len(head) + len(tail)}Q", len(token_ids), *head, *tail)
    return hashlib.blake2b(packed, digest_size=16).digest()


def rendezvous_rank(fingerprint: bytes, endpoint: str) -> float:
    """The rendezvous (highest random weight) rank of ``endpoint`` for a prompt: in [0, 1),
    uniform over endpoints for a random prompt, the same for the same pair everywhere."""
    digest = hashlib.blake2b(endpoint.encode(), digest_size=8, key=fingerprint).digest()
    return int.from_bytes(digest, "big") / 2**64


@register
class RandomPicker(_RankingPicker):
    type_name = "random-picker"

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        return [(rng.random(), 0.0) for _ in scored]


@register
class WeightedRandomPicker(_RankingPicker):
    type_name = "weighted-random-picker"

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        if all(s.score <= 0 for s in scored):
            return [(rng.random(), 0.0) for _ in scored]
        # Zero-score endpoints rank after every positive one, in random order among themselves.
        return [
            (rng.random() ** (1.0 / s.score), 1.0) if s.score > 0 else (-1.0, rng.random()) for s in scored
        ]


@register
class SoftmaxPicker(_RankingPicker):
    type_name = "softmax-picker"
    Parameters = SoftmaxPickerParameters
    params: SoftmaxPickerParameters

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        rng = self.context.rng
        temperature = self.params.temperature
        hi = max(s.score for s in scored)
        span = hi - min(s.score for s in scored)
        if temperature == 0 or span == 0:  # argmax (or all equal): ties at random
            return [(s.score, rng.random()) for s in scored]
        # Gumbel-max: argmax of logit + Gumbel noise (−log of an Exp(1) draw) is a softmax sample;
        # sorting by the noisy logits gives the rest of a Plackett–Luce order.
        return [
            (-(hi - s.score) / (span * temperature) - math.log(max(rng.expovariate(1.0), 1e-300)), 0.0)
            for s in scored
        ]


@register
class RoundRobinPicker(_RankingPicker):
    type_name = "round-robin"

    def __init__(self, name: str, params: PickerParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._turn = itertools.count()

    def _keys(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[tuple[float, float]]:
        by_name = sorted(range(len(scored)), key=lambda i: scored[i].state.name)
        start = next(self._turn) % len(scored)
        keys = [(0.0, 0.0)] * len(scored)
        for position, i in enumerate(by_name):
            keys[i] = (-float((position - start) % len(scored)), 0.0)
        return keys
