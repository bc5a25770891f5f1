"""The simulated client's output-length hint (``FleetConfig.output_hint_sigma``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from sim.fleet import FleetConfig, FleetSimulator, Workload
from sim.fleet.replica import Replica
from sim.fleet.routers import Router, RoutingCall
from tests.fleet.sessions import random_sessions


class Recorder(Router):
    """Routes everything to the first replica and notes each request's hint, by request id."""

    name = "recorder"

    def __init__(self) -> None:
        self.hints: dict[str, tuple[str | None, int | None, int]] = {}

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        request = call.request
        header = request.headers.get("x-expected-output-tokens")
        self.hints[request.request_id] = (header, request.expected_output_tokens, call.output_tokens)
        return replicas[0]


def hints(sigma: float | None, seed: int = 0) -> dict[str, tuple[str | None, int | None, int]]:
    recorder = Recorder()
    workload = Workload("t", random_sessions(6, 3, seed=4))
    FleetSimulator(
        workload, lambda clock: recorder, FleetConfig(replicas=1, seed=seed, output_hint_sigma=sigma)
    ).run()
    assert len(recorder.hints) == workload.num_requests
    return recorder.hints


def test_no_hint_unless_asked() -> None:
    assert all(header is None and hint is None for header, hint, _ in hints(None).values())


def test_an_exact_hint_is_the_true_length_in_the_header_and_the_request() -> None:
    assert all(header == str(truth) and hint == truth for header, hint, truth in hints(0.0).values())


def test_a_noisy_hint_is_lognormal_around_the_truth_and_the_same_for_every_router() -> None:
    noisy = hints(0.5)
    assert noisy == hints(0.5)  # seeded by the seed and the request id, not by routing
    assert noisy != hints(0.5, seed=1)
    assert all(header == str(hint) for header, hint, _ in noisy.values())
    # log(hint / truth) ~ N(0, 0.5); answers of 20 tokens or more, so rounding hardly matters.
    logs = [math.log(hint / truth) for _, hint, truth in noisy.values() if hint is not None and truth >= 20]
    assert len(logs) >= 12 and 0.25 < statistics.pstdev(logs) < 0.8 and abs(statistics.fmean(logs)) < 0.4
