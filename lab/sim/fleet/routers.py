"""The router interface of the fleet simulator, and the router that runs an EPP pipeline.

A pipeline router runs the real scheduling core and plugins of an EndpointPickerConfig with a
virtual clock, a seeded RNG and an in-process latency predictor, and drives the same request
lifecycle as the live director (``epp.requestcontrol.lifecycle``): routed, first token,
progress, finished, each at the engine's event time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import epp.plugin_types  # noqa: F401  (registers every plugin type)
from epp.configs import config_path
from epp.errors import RequestError
from epp.latency.drift import DriftEvent
from epp.latency.report import chosen_prediction
from epp.plugins.predicted_latency import find_predicted_latency
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext
from epp.scheduling.observers import RoutedRequest
from epp.scheduling.pipeline import NoCandidates
from epp.scheduling.types import LLMRequest
from sim.fleet.predictor import InProcessPredictor
from sim.fleet.replica import Replica

if TYPE_CHECKING:
    from sim.fleet.flow_gate import FleetFlowGate

EPOCH = 1.7e9
"""Virtual time 0 as seconds since the epoch (for the timestamps of training samples)."""


class RoutingRejected(Exception):
    """The router refused the request; ``reason`` says why (a short label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class RoutingCall:
    """One request being routed, the truth about it that only the oracle may read, and what the
    router kept about its decision."""

    request: LLMRequest
    output_tokens: int
    block_digests: list[bytes]
    """The engine's names of the prompt's full KV blocks."""
    routed: RoutedRequest | None = None
    """Set by a pipeline router: the request as its lifecycle follows it."""


class Router:
    """Base of the simulator's routers; override ``route`` and the steps you need."""

    name: str
    wants_progress: bool = False
    """Whether ``on_progress`` does anything (the simulator skips the calls otherwise)."""
    flow_gate: FleetFlowGate | None = None
    """Flow control: where the simulator holds arrivals while the pool is saturated."""

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        """The replica that serves ``call``; raises :class:`RoutingRejected` to refuse it."""
        raise NotImplementedError

    def on_first_token(self, call: RoutingCall, now: float) -> None:
        """The first output token reached the gateway."""

    def on_progress(self, call: RoutingCall, tokens: int, now: float) -> None:
        """``tokens`` output tokens have streamed."""

    def on_finished(self, call: RoutingCall, now: float, *, completed: bool, completion_tokens: int) -> None:
        """The request is over: completed with ``completion_tokens``, or refused by the engine."""

    def tick(self, now: float) -> None:
        """Periodic work in virtual time (retraining)."""

    def drift_events(self) -> list[DriftEvent]:
        """When the router's latency model started and stopped drifting (none without one)."""
        return []

    def predicted(self, call: RoutingCall) -> tuple[float, float] | None:
        """Predicted (TTFT ms, TPOT ms) on the chosen endpoint, when the router predicted."""
        return None

    def scrape_lag_s(self, endpoint: str) -> float | None:
        """With scrape sharing among EPP replicas: how late the replicas that do not own
        ``endpoint`` read its scrapes (None: every replica reads each scrape at its tick)."""
        return None

    def close(self) -> None:
        """Release resources."""


def run_to_completion(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (every producer answers at once) without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("a producer suspended; the fleet simulator needs producers that answer at once")


class PipelineRouter(Router):
    """A shipped (or any) EndpointPickerConfig, run by the real scheduling pipeline."""

    def __init__(
        self,
        config: str,
        clock: Callable[[], float],
        seed: int,
        *,
        name: str | None = None,
        predictor: InProcessPredictor | None = None,
    ) -> None:
        """``predictor``: a latency predictor shared with other routers (closed by its owner);
        by default the router has its own."""
        self.name = name or config
        self._owns_predictor = predictor is None
        self.predictor = predictor or InProcessPredictor(seed=seed)
        self.context = PluginContext(
            clock=clock,
            rng=random.Random(seed),
            wall_clock=lambda: EPOCH + clock(),
            latency_predictor=self.predictor,
        )
        self.pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path(config)), self.context)
        self.lifecycle = RequestLifecycle(self.pipeline)
        self.wants_progress = self.lifecycle.wants_progress
        self._by_name: dict[str, Replica] = {}

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        if len(self._by_name) != len(replicas):
            self._by_name = {replica.name: replica for replica in replicas}
        candidates = [replica.state for replica in replicas]
        try:
            routed = run_to_completion(self.lifecycle.route(call.request, candidates, now, now))
        except NoCandidates:
            raise RoutingRejected("no_candidates") from None
        except RequestError as error:
            raise RoutingRejected(error.dropped_reason or type(error).__name__) from None
        call.routed = routed
        if routed.endpoint_name not in self._by_name:  # ``replicas`` was a subset (flow control's fit)
            self._by_name = {replica.name: replica for replica in replicas}
        return self._by_name[routed.endpoint_name]

    def on_first_token(self, call: RoutingCall, now: float) -> None:
        self.lifecycle.first_token(call.routed, now)  # type: ignore[arg-type]  (set by route)

    def on_progress(self, call: RoutingCall, tokens: int, now: float) -> None:
        self.lifecycle.progress(call.routed, tokens, now)  # type: ignore[arg-type]

    def on_finished(self, call: RoutingCall, now: float, *, completed: bool, completion_tokens: int) -> None:
        # An engine's refusal reaches the client as a 400 before any token.
        self.lifecycle.finished(
            call.routed,  # type: ignore[arg-type]
            now,
            status=200 if completed else 400,
            completed=completed,
            streaming=True,
            completion_tokens=completion_tokens if completed else None,
        )

    def tick(self, now: float) -> None:
        if self.predictor.service.windows["ttft"].added_total:
            self.predictor.retrain()

    def drift_events(self) -> list[DriftEvent]:
        producer = find_predicted_latency(self.pipeline.plugins.values())
        return list(producer.drift.events) if producer is not None else []

    def predicted(self, call: RoutingCall) -> tuple[float, float] | None:
        routed = call.routed
        chosen = chosen_prediction(routed.state, routed.endpoint_name) if routed is not None else None
        return None if chosen is None else (chosen.ttft_ms, chosen.tpot_ms)

    def close(self) -> None:
        if self._owns_predictor:
            self.predictor.close()
