"""One simulated engine of the fleet, advanced in virtual time, and what the EPP may see of it."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from epp.scheduling.types import Endpoint, EndpointState, EngineMetrics
from sim.engine import Engine, EngineRequest, Profile, RequestOutput, ScheduledStep
from sim.engine.pool import PROFILE_LABEL
from sim.fleet.prompts import OUTPUT_VOCAB

LifecycleSink = Callable[[float, "Replica", RequestOutput], None]
"""Receives (time, replica, output) for every first token and every finish."""


class Replica:
    """An engine, its step in flight, and the endpoint state the EPP's scraper last recorded.

    ``advance(t)`` completes every step that ends by ``t``. While the batch only decodes, whole
    stretches of steps run at once (``Engine.fast_forward_decode``), bounded by ``t``, so the
    simulation does per-step work only where the batch changes.
    """

    def __init__(self, index: int, profile: Profile) -> None:
        self.index = index
        self.profile = profile
        self.engine = Engine(profile.engine, profile.cost, OUTPUT_VOCAB)
        self.step: ScheduledStep | None = None
        self.arriving: dict[str, EngineRequest] = {}
        """Requests routed here and still in the server's front end (not yet in the engine)."""
        config = profile.engine
        self.state = EndpointState(
            Endpoint(
                name=f"replica-{index}",
                address="10.0.0.1",
                port=8000 + index,
                labels={PROFILE_LABEL: profile.name},
            ),
            EngineMetrics(block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks),
        )
        self.shared_lag_s: float | None = None
        """With scrape sharing: how late the EPP replicas that do not own this engine read its
        scrapes (``Router.scrape_lag_s``); the simulator then scrapes at every tick."""
        self._scrapes: deque[EngineMetrics] = deque(maxlen=64)
        """The recent scrapes, oldest first (with ``shared_lag_s`` only)."""

    @property
    def name(self) -> str:
        return self.state.endpoint.name

    def advance(self, until: float, sink: LifecycleSink) -> None:
        engine = self.engine
        step = self.step
        while step is not None and step.end_time <= until:
            now = step.end_time
            for output in engine.finish_step(step, now):
                if output.is_first_token or output.finish_reason is not None:
                    sink(now, self, output)
            now, _ = engine.fast_forward_decode(now, until)
            step = engine.schedule(now)
        self.step = step

    def add(self, request: EngineRequest, now: float) -> None:
        """Queue a request (raises ``RequestRejectedError`` if the engine can never serve it)."""
        self.arriving.pop(request.request_id, None)
        self.engine.add_request(request, now)
        if self.step is None:
            self.step = self.engine.schedule(now)

    def outstanding(self) -> int:
        """Requests routed here and not finished: in the front end, waiting or running."""
        engine = self.engine
        return len(self.arriving) + engine.num_waiting + engine.num_running

    def scrape(self, now: float) -> None:
        """Record the engine's gauges as the EPP's metrics scraper would read them now."""
        metrics = self.state.metrics
        engine = self.engine
        metrics.waiting = engine.num_waiting
        metrics.running = engine.num_running
        metrics.kv_cache_usage = engine.kv_usage
        metrics.updated_at = now
        if self.shared_lag_s is not None:
            self._scrapes.append(dataclasses.replace(metrics))

    def shared_metrics(self, now: float) -> EngineMetrics:
        """The gauges as an EPP replica that does not own this engine sees them at ``now``: the
        latest scrape whose owner's message has arrived (``shared_lag_s`` after it)."""
        assert self.shared_lag_s is not None
        cutoff = now - self.shared_lag_s
        for metrics in reversed(self._scrapes):
            if metrics.updated_at <= cutoff:
                return metrics
        return self._scrapes[0] if self._scrapes else self.state.metrics

    def next_finish_bound(self) -> float:
        """A time before which no request on this engine can finish."""
        step = self.step
        if step is None:
            return float("inf")
        engine = self.engine
        if engine.waiting or step.num_prefill_tokens:
            return step.end_time
        fewest = min(_output_limit(r) - len(r.output_token_ids) for r in engine.running)
        # Decode steps only grow longer while the batch is unchanged.
        return step.end_time + max(0, fewest - 1) * step.duration

    def active_decode_blocks(self) -> int:
        """KV blocks held by requests that are decoding."""
        return sum(len(r.blocks) for r in self.engine.running if r.num_computed_tokens >= r.num_prompt_tokens)


def _output_limit(request: EngineRequest) -> int:
    stop = request.stop_after_tokens
    return request.max_output_tokens if stop is None else min(stop, request.max_output_tokens)
