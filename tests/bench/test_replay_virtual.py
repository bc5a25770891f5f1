"""``llm-epp-bench replay --virtual``: the replay's window through the fleet simulator (virtual time)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.runs.live_replay import ReplaySettings, run_virtual
from sim.fleet.workload import Session, Turn, Workload


def test_only_requests_arriving_within_the_duration_are_reported(tmp_path: Path) -> None:
    # Two sessions of three turns at fixed offsets 0, 4 and 8 s: with a 6-second window, turns
    # 0 and 1 of each count (four requests, two of them first turns) and turn 2 does not.
    turns = tuple(Turn(200, 4, prefix="previous" if i else "none", offset_s=4.0 * i) for i in range(3))
    workload = Workload("two-sessions", [Session("a", 0.0, turns), Session("b", 1.0, turns)])
    settings = ReplaySettings(
        configs=("round-robin", "least-request"), duration_s=6.0, profile="instant", replicas=2
    )
    data = run_virtual(settings, tmp_path, workload)

    assert [r["config"] for r in data["results"]] == ["round-robin", "least-request"]
    for result in data["results"]:
        assert result["requests"] == 4
        first, later = result["ttft_ms_by_turn"]["first"], result["ttft_ms_by_turn"]["later"]
        assert first["p50"] is not None and later["p50"] is not None
        assert 0 < result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"]
    written = json.loads((tmp_path / "replay-virtual-two-sessions.json").read_text())
    assert written["results"] == data["results"]
    markdown = (tmp_path / "replay-virtual-two-sessions.md").read_text()
    assert "| round-robin | 4 |" in markdown and "the first 6 s" in markdown
