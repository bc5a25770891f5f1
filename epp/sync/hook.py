"""Feeds the request lifecycle of one pipeline into its :class:`~epp.sync.state.ReplicaSyncState`.

:func:`attach_replica_sync` appends a :class:`ReplicaSyncHook` to the pipeline's pre-request hooks
and response observers, after every configured plugin, so it reads what they booked: the
token-load producer's terms for the request, the prefix blocks the approximate index recorded,
the TPOT SLO the predicted-latency producer runs. It publishes only those facts (routed, first
token, progress, finished), never anything the transport does, so the live director and the
fleet simulator feed it the same way. :func:`sync_targets` names the structures where the
peers' deltas go.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from epp.plugins.predicted_latency import PredictedLatencyProducer
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer
from epp.plugins.token_load import TokenLoadProducer, find_token_load
from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import (
    CycleState,
    PluginContext,
    PluginParameters,
    PreRequest,
    RequestOutcome,
    ResponseObserver,
)
from epp.scheduling.pipeline import Pipeline
from epp.scheduling.types import LLMRequest, SchedulingResult
from epp.sync.state import ReplicaSyncState, SyncTargets

HOOK_NAME = "replica-sync"
P = TypeVar("P")


def _find(plugins: Iterable[object], cls: type[P]) -> P | None:
    return next((p for p in plugins if isinstance(p, cls)), None)


def sync_targets(pipeline: Pipeline) -> SyncTargets:
    """Where peers' deltas are applied in ``pipeline``: the token-load producer's peer tracker,
    the approximate prefix index, the running TPOT SLOs (each None if the config has none)."""
    plugins = list(pipeline.plugins.values())
    token_load = find_token_load(plugins)
    prefix = _find(plugins, ApproximatePrefixCacheProducer)
    latency = _find(plugins, PredictedLatencyProducer)
    return SyncTargets(
        token_load=token_load.peers if token_load is not None else None,
        tpot_slos=latency.running_tpot_slos if latency is not None else None,
        record_prefix=prefix.record if prefix is not None else None,
        prefix_block_size=prefix.params.block_size_tokens if prefix is not None else 0,
    )


class ReplicaSyncHook(PreRequest, ResponseObserver):
    """Reports each routed request's lifecycle to a :class:`ReplicaSyncState` (see the module)."""

    type_name = HOOK_NAME

    def __init__(self, pipeline: Pipeline, sync: ReplicaSyncState, context: PluginContext) -> None:
        super().__init__(HOOK_NAME, PluginParameters(), context)
        self.sync = sync
        plugins = list(pipeline.plugins.values())
        self._token_load: TokenLoadProducer | None = find_token_load(plugins)
        prefix = _find(plugins, ApproximatePrefixCacheProducer)
        self._prefix_block_size = prefix.params.block_size_tokens if prefix is not None else 0
        latency = _find(plugins, PredictedLatencyProducer)
        self._tpot_slos = latency.running_tpot_slos if latency is not None else None

    def pre_request(self, request: LLMRequest, result: SchedulingResult, state: CycleState) -> None:
        endpoint = result.endpoint.name
        terms = self._token_load.tracker.terms(state.key) if self._token_load is not None else None
        slo = self._tpot_slos.get(endpoint, {}).get(state.key) if self._tpot_slos is not None else None
        if terms is not None or slo is not None:
            self.sync.routed(
                state.key,
                endpoint,
                kv_tokens=terms.prompt_tokens if terms else 0,
                uncached_tokens=terms.uncached_tokens if terms else 0,
                expected_output=terms.expected_output if terms else 0,
                tpot_slo_ms=slo,
            )
        match = state.get(PREFIX_MATCH)
        if self._prefix_block_size and match is not None and match.block_hashes:
            self.sync.prefix_inserted(endpoint, self._prefix_block_size, match.block_hashes)

    def on_first_token(
        self, request: LLMRequest, result: SchedulingResult, state: CycleState, now: float
    ) -> None:
        self.sync.first_token(state.key)

    def on_progress(
        self, request: LLMRequest, result: SchedulingResult, state: CycleState, tokens: int, now: float
    ) -> None:
        self.sync.progress(state.key, tokens)

    def on_finished(
        self, request: LLMRequest, result: SchedulingResult, state: CycleState, outcome: RequestOutcome
    ) -> None:
        self.sync.released(state.key)


def attach_replica_sync(
    pipeline: Pipeline, sync: ReplicaSyncState, context: PluginContext
) -> ReplicaSyncHook:
    """Hook ``sync`` into ``pipeline``: it runs after every configured pre-request hook and observer."""
    hook = ReplicaSyncHook(pipeline, sync, context)
    pipeline.plugins[HOOK_NAME] = hook
    pipeline.pre_request.append(hook)
    pipeline.observers.append(hook)
    return hook
