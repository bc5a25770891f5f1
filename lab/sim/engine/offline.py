"""One simulated engine serving requests in virtual time, with no server around it: for the
benchmarks that check a profile's step model on its own (``bench.runs.published_check``,
``sim.fitting.term_attribution``)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.engine.engine import Engine
from sim.engine.profile import Profile
from sim.engine.request import EngineRequest


def distinct_prompt(index: int, tokens: int) -> list[int]:
    """``tokens`` token ids that share no prefix with another index's (for the first 24 indexes)."""
    return [10_000 + (index * 4096 + t) % 100_000 for t in range(tokens)]


def serve_offline(profile: Profile, arrivals: Sequence[tuple[float, EngineRequest]]) -> None:
    """Serve each request from its arrival (virtual seconds) to its end on one engine of
    ``profile``; their first-token and finish times are then set. Requests that arrive while a
    step runs join at the next schedule, as in vLLM."""
    engine = Engine(profile.engine, profile.cost, range(1000, 2000))
    pending = sorted(arrivals, key=lambda arrival: arrival[0])
    now, next_arrival = 0.0, 0
    while next_arrival < len(pending) or engine.has_unfinished_requests():
        if next_arrival < len(pending) and (
            pending[next_arrival][0] <= now or not engine.has_unfinished_requests()
        ):
            now = max(now, pending[next_arrival][0])
            engine.add_request(pending[next_arrival][1], now)
            next_arrival += 1
            continue
        step = engine.schedule(now)
        if step is None:
            raise RuntimeError(f"the engine of {profile.name} cannot serve these requests")
        now = step.end_time
        engine.finish_step(step, now)
