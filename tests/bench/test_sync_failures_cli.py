"""``llm-epp-bench sync-failures`` end to end, shortened: both kills, the soak and a 2 s NATS outage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main

pytestmark = pytest.mark.integration


def test_sync_failures_reports_every_scenario_with_its_outcomes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    main(["sync-failures", "--after-kill", "4", "--outage", "2", "--soak-streams", "16", "--out", str(out)])
    data = json.loads((out / "sync_failures.json").read_text())
    assert (out / "sync_failures.png").stat().st_size > 0
    assert "## NATS stopped under load" in (out / "sync_failures.md").read_text()
    open_kill, close_kill = data["kills"]
    for kill in data["kills"]:
        assert kill["sent"] == kill["ok"] + kill["failed"] == len(kill["timeline"]) > 0
        # The survivor expired the dead replica, and with it every booking it held.
        assert kill["peer_expired_s"] is not None and kill["remote_share_zero_s"] is not None
    assert (open_kill["scenario"], open_kill["failed"]) == ("kill-FailOpen", 0)
    assert close_kill["failed"] <= close_kill["in_flight_at_kill"] + 2, close_kill["failures"]
    soak = data["soak"]
    assert soak["ok"] == soak["sent"] == 16 and sum(soak["served_per_epp"]) == 16
    assert [any(g.values()) for g in soak["gauges_after"].values()] == [False, False]
    outage = data["outage"]
    assert outage["failed"] == 0 and outage["sent_by_window"]["during"] > 0
    assert outage["converged_after_restart_s"] is not None
