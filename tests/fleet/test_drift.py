"""Prediction drift in the fleet simulator: the engines slow down mid-run, the EPP notices its
live error, routes on heuristics and asks for a retrain, and trusts the new model once its error
is back down."""

from __future__ import annotations

import random
from pathlib import Path

from epp.configs import config_path
from sim.fleet import FleetConfig, FleetSimulator, ProfileSwitch, Session, Turn, Workload, make_router

SWITCH_AT_S = 20.0


def _workload() -> Workload:
    rng = random.Random(1)
    sessions = [
        Session(f"s{i}", rng.uniform(0, 90.0), (Turn(rng.randint(200, 2000), rng.randint(20, 200)),))
        for i in range(700)
    ]
    return Workload("drift", sessions, slo_ttft_ms=2000, slo_tpot_ms=100)


def _config(tmp_path: Path) -> str:
    """The shipped predicted-latency config with a 40-request drift window."""
    text = config_path("predicted-latency").read_text()
    text = text.replace("    streamingMode: true\n", "    streamingMode: true\n    driftWindow: 40\n")
    assert "driftWindow" in text
    path = tmp_path / "drift.yaml"
    path.write_text(text)
    return str(path)


def test_engines_slowing_down_is_detected_falls_back_and_recovers(tmp_path: Path) -> None:
    config = _config(tmp_path)
    slow_down = ProfileSwitch(SWITCH_AT_S, slowdown=3.0)
    fleet = FleetConfig(replicas=3, retrain_interval_s=5.0, switches=(slow_down,))
    result = FleetSimulator(_workload(), lambda clock: make_router(config, clock, 7), fleet).run()

    started, ended = result.drift_events[0], result.drift_events[1]
    # Detected after the switch, within the time a window of requests takes to finish there.
    assert started.drifting and SWITCH_AT_S < started.at < SWITCH_AT_S + 20
    # Recovered on a newer model, retrained on the slow engines' samples.
    assert not ended.drifting and ended.at > started.at and ended.version > started.version
    assert ended.mape <= 0.3
    # While it drifted, requests were routed without predictions; before and after, with.
    during = [r for r in result.records if started.at + 1 < r.arrival < ended.at - 1]
    assert during and all(r.predicted_ttft_ms is None for r in during)
    after = [r for r in result.records if r.arrival > ended.at + 1]
    assert after and sum(r.predicted_ttft_ms is not None for r in after) > 0.9 * len(after)
    # The first model is served from about 12 s (100 TTFT samples).
    before = [r for r in result.records if 13 < r.arrival < SWITCH_AT_S]
    assert sum(r.predicted_ttft_ms is not None for r in before) > 0.9 * len(before)
