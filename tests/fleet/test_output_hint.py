"""The simulated client's output-length hint (``FleetConfig.output_hint_sigma``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from epp.configs import config_path
from sim.fleet import FleetConfig, FleetSimulator, Workload, make_router
from sim.fleet.replica import Replica
from sim.fleet.routers import Router, RoutingCall
from tests.fleet.sessions import fingerprint, random_sessions


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


OUTPUT_KNOBS = ("weighByExpectedOutput", "gateOnExpectedOutput", "predictOutputsFrom")


def test_without_a_hint_the_output_length_knobs_change_no_decision(tmp_path: Path) -> None:
    shipped = config_path("predicted-latency-token-load").read_text()
    assert all(knob in shipped for knob in OUTPUT_KNOBS)
    stripped = tmp_path / "without-knobs.yaml"
    stripped.write_text(
        "".join(
            line for line in shipped.splitlines(keepends=True) if not any(k in line for k in OUTPUT_KNOBS)
        )
    )
    workload = Workload("t", random_sessions(40, 3, seed=5, spread_s=15.0), slo_ttft_ms=500, slo_tpot_ms=50)
    config = FleetConfig(
        replicas=3, profile="llama-3.1-8b-h100:2,llama-3.1-8b-h100+slowdown=2.5:1", retrain_interval_s=2.0
    )

    def run(router: str) -> list[tuple]:
        result = FleetSimulator(workload, lambda clock: make_router(router, clock, 3), config).run()
        assert any(r.predicted_ttft_ms is not None for r in result.records)
        return fingerprint(result)

    assert run("predicted-latency-token-load") == run(str(stripped))
