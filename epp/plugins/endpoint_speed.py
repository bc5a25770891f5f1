"""``endpoint-speed-producer``: each endpoint's measured slowness (``ENDPOINT_SPEED``), no label needed.

Learns, from each completed streamed request, how long the endpoint that served it takes per
decode step against the pool's other endpoints under the same conditions (the batch, and the
prompt tokens prefilled beside it; ``epp.load.endpoint_speed``),
and writes each candidate's slowness before scheduling: 1 for the pool's typical endpoint (and
for one not yet measured), 2.5 for an engine 2.5 times slower. With it in a config,
``token-load-scorer`` counts each endpoint's load in time rather than tokens, so a slow replica
is sent its share of the work, not an equal one, from its first completed requests on (no
latency model needed: it also holds while the predictor warms up).

The conditions a request decoded under come from what the EPP routed: the mean batch from the
token load it books (``TOKEN_LOAD``: this EPP's and, when synced, its peers'), sampled each time
an endpoint is a candidate; the prompt tokens prefilled beside it from this EPP's own requests'
first tokens there (their uncached prompt, by the prefix match), per decode step.

========  =======  ====================================================================
parameter default  meaning
========  =======  ====================================================================
halfLife  20       requests of an endpoint under one condition bin after which its
                   measured step time there weighs half (how fast a change of speed is
                   followed)
========  =======  ====================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import Field

from epp.load.endpoint_speed import DecodeMark, EndpointSpeeds
from epp.load.token_load import NO_LOAD
from epp.scheduling.cycle_data import ENDPOINT_SPEED, PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import (
    CycleState,
    DataKey,
    DataProducer,
    Plugin,
    PluginContext,
    PluginParameters,
    RequestOutcome,
)
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest

_DECODE_MARK: DataKey[DecodeMark] = DataKey("endpoint-speed-decode-mark")
"""This producer's own: where the request's decode began on its endpoint."""


class EndpointSpeedParameters(PluginParameters):
    half_life: float = Field(default=20.0, gt=0, le=10_000, alias="halfLife")


@register
class EndpointSpeedProducer(DataProducer, LifecycleObserver):
    type_name = "endpoint-speed-producer"
    Parameters = EndpointSpeedParameters
    produces = (ENDPOINT_SPEED,)
    consumes = (TOKEN_LOAD,)
    reads_if_present = (PREFIX_MATCH,)
    params: EndpointSpeedParameters

    def __init__(self, name: str, params: EndpointSpeedParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.speeds = EndpointSpeeds(params.half_life)

    def produce(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState) -> None:
        now = self.context.clock()
        loads = state.get(TOKEN_LOAD) or {}
        speeds = self.speeds
        for e in endpoints:
            speeds.counts.sample(e.name, now, loads.get(e.name, NO_LOAD).requests)
        state.put(ENDPOINT_SPEED, {e.name: speeds.slowness(e.name) for e in endpoints})

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        request, state = routed.request, routed.state
        target = routed.result.endpoint.name
        state.put(_DECODE_MARK, self.speeds.counts.mark(target, now))
        match = state.get(PREFIX_MATCH)
        cached = match.cached_tokens(target, request.input_tokens) if match else 0
        self.speeds.counts.prefilled(target, now, request.input_tokens - cached)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        started = routed.state.get(_DECODE_MARK)
        tpot_s, tokens = outcome.tpot_s, outcome.completion_tokens
        if started is None or not outcome.completed or tpot_s is None or tokens is None:
            return
        self.speeds.decode_finished(routed.result.endpoint.name, started, outcome.finished_at, tokens, tpot_s)


@runtime_checkable
class MeasuresEndpointSpeed(Protocol):
    """A plugin that measures each endpoint's slowness (exported per endpoint by the EPP)."""

    speeds: EndpointSpeeds


def find_endpoint_speeds(plugins: Iterable[Plugin]) -> EndpointSpeeds | None:
    """The endpoint speeds measured by one of ``plugins``, if any measures them."""
    return next((p.speeds for p in plugins if isinstance(p, MeasuresEndpointSpeed)), None)
