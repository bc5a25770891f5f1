"""What the state at a routing decision determines of a request's latency.

``foresee`` copies the chosen replica (its step in flight, queue, batch, KV cache and the
requests still in its front end), adds the request after its front-end delay, and runs the copy
with no later arrival until the request's first token and its last. The copy knows the engine's
exact state and the request's true output length, which no router does; what it cannot know is
what arrives later. Its error against what happened is therefore a floor for any predictor of
the state at the decision (``bench.runs.prediction_floor``).

One simplification: requests still in the copy's front end enter its engine at once, not after
their own remaining delays (a few milliseconds).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from sim.engine import EngineRequest, RequestOutput, RequestRejectedError
from sim.fleet.replica import Replica

HORIZON_S = 1.0
"""How far the copy runs between looks at whether the request finished: whole stretches of plain
decode steps run at once within it (``Engine.fast_forward_decode``)."""


@dataclass(frozen=True, slots=True)
class Foreseen:
    """A request's latencies on a copy of its replica that no later request reaches."""

    ttft_s: float
    tpot_s: float | None
    """None for a one-token answer."""


def foresee(replica: Replica, request: EngineRequest, delay_s: float) -> Foreseen | None:
    """``request`` (routed to ``replica`` at ``request.arrival_time``, entering its engine
    ``delay_s`` later) run on a copy of the replica with nothing arriving after it; None if the
    engine refuses it. Neither ``replica`` nor ``request`` is changed."""
    now = request.arrival_time
    if now is None:
        raise ValueError("the request needs its arrival_time (the routing decision's time)")
    twin = copy.deepcopy(replica)
    mine = copy.deepcopy(request)
    first: list[float] = []
    last: list[float] = []

    def sink(when: float, _replica: Replica, output: RequestOutput) -> None:
        if output.request is not mine:
            return
        if output.is_first_token:
            first.append(when)
        if output.finish_reason is not None:
            last.append(when)

    for waiting in list(twin.arriving.values()):
        twin.add(waiting, now)
    twin.advance(now + delay_s, sink)
    try:
        twin.add(mine, now + delay_s)
    except RequestRejectedError:
        return None
    while not last and twin.step is not None:
        twin.advance(twin.step.end_time + HORIZON_S, sink)
    tokens = len(mine.output_token_ids)
    tpot = (last[0] - first[0]) / (tokens - 1) if tokens > 1 else None
    return Foreseen(first[0] - now, tpot)
