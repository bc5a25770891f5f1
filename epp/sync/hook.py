"""Feeds one pipeline's request lifecycle into its :class:`~epp.sync.state.ReplicaSyncState`.

:func:`attach_replica_sync` adds a :class:`ReplicaSyncHook` to the request lifecycle
(``epp.requestcontrol.lifecycle``) as an observer, which hears every step after the pipeline's
plugins, so it reads what they booked: the token-load producer's terms for the request, the
prefix blocks the approximate index recorded, the TPOT SLO the predicted-latency producer runs.
It publishes only those lifecycle events (routed, first token, progress, finished), never
anything the transport does, so the live director and the fleet simulator feed it the same way.
:func:`sync_targets` names the structures where the peers' deltas go.
"""

from __future__ import annotations

from typing import Protocol

from epp.plugins.predicted_latency import find_predicted_latency
from epp.plugins.prefix_cache import find_prefix_index
from epp.plugins.token_load import BooksTokenLoad, find_token_load
from epp.scheduling.cycle_data import PREFIX_MATCH
from epp.scheduling.framework import RequestOutcome, RunsAmongReplicas
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.pipeline import Pipeline
from epp.scheduling.types import EndpointState
from epp.sync.state import ReplicaSyncState, SyncTargets


def sync_targets(pipeline: Pipeline) -> SyncTargets:
    """Where peers' deltas are applied in ``pipeline``: the token-load producer's ``peers``,
    the approximate prefix index (and what of it a snapshot carries), the running TPOT SLOs
    (each None if the config has none)."""
    plugins = list(pipeline.plugins.values())
    token_load = find_token_load(plugins)
    prefix = find_prefix_index(plugins)
    latency = find_predicted_latency(plugins)
    return SyncTargets(
        token_load=token_load.peers if token_load is not None else None,
        tpot_slos=latency.running_tpot_slos if latency is not None else None,
        record_prefix=prefix.record if prefix is not None else None,
        prefix_block_size=prefix.block_size_tokens if prefix is not None else 0,
        prefix_blocks=prefix.index.recent_blocks if prefix is not None else None,
    )


class ReplicaSyncHook(LifecycleObserver):
    """Reports each routed request's lifecycle to a :class:`ReplicaSyncState` (see the module)."""

    def __init__(self, pipeline: Pipeline, sync: ReplicaSyncState) -> None:
        self.sync = sync
        plugins = list(pipeline.plugins.values())
        self._token_load: BooksTokenLoad | None = find_token_load(plugins)
        prefix = find_prefix_index(plugins)
        self._prefix_block_size = prefix.block_size_tokens if prefix is not None else 0
        latency = find_predicted_latency(plugins)
        self._tpot_slos = latency.running_tpot_slos if latency is not None else None

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        endpoint, key = routed.endpoint_name, routed.state.key
        terms = self._token_load.tracker.terms(key) if self._token_load is not None else None
        slo = self._tpot_slos.get(endpoint, {}).get(key) if self._tpot_slos is not None else None
        match = routed.state.get(PREFIX_MATCH)
        if terms is not None or slo is not None:
            self.sync.routed(
                key,
                endpoint,
                kv_tokens=terms.prompt_tokens if terms else 0,
                uncached_tokens=terms.uncached_tokens if terms else 0,
                expected_output=terms.expected_output if terms else 0,
                tpot_slo_ms=slo,
                prompt_tail=match.block_hashes[-1] if match is not None and match.block_hashes else None,
            )
        if self._prefix_block_size and match is not None and match.block_hashes:
            self.sync.prefix_inserted(endpoint, self._prefix_block_size, match.block_hashes)

    def on_rebooked(self, routed: RoutedRequest, previous: EndpointState, now: float) -> None:
        self.sync.released(routed.state.key)
        self.on_routed(routed, now)

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        self.sync.first_token(routed.state.key)

    def on_progress(self, routed: RoutedRequest, tokens: int, now: float) -> None:
        self.sync.progress(routed.state.key, tokens)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self.sync.released(routed.state.key)


class ObservedPipeline(Protocol):
    """A pipeline's request lifecycle, which tells observers each step
    (``epp.requestcontrol.lifecycle.RequestLifecycle`` is one)."""

    pipeline: Pipeline

    def add_observer(self, observer: LifecycleObserver) -> None: ...


def attach_replica_sync(lifecycle: ObservedPipeline, sync: ReplicaSyncState) -> ReplicaSyncHook:
    """Hook ``sync`` into ``lifecycle``: it hears each step after the pipeline's plugins and the
    observers added before it. Every plugin that ``RunsAmongReplicas`` is told so (while peers
    are alive, a ``max-score-picker`` breaks ties the same way in each replica,
    ``replicaTieBreak``; a ``token-load-scorer`` weighs its ``replicaMoveMargin``; a
    ``prefix-cache-affinity-filter`` keeps its token-load gate shut)."""
    for plugin in lifecycle.pipeline.plugins.values():
        if isinstance(plugin, RunsAmongReplicas):
            plugin.join_replicas(lambda: sync.peer_count)
    hook = ReplicaSyncHook(lifecycle.pipeline, sync)
    lifecycle.add_observer(hook)
    return hook
