"""``llm-epp-bench flow-control`` end to end on a short overload: the files, the tenant table, the
goals, a clear error for an unknown variant; and the backlog growth capacity is measured by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.runs.flow_control import backlog_growth
from sim.fleet import SimulatedRequest


def test_flow_control_writes_the_tenant_by_policy_table(tmp_path: Path) -> None:
    variants = "no flow control,least-attained-service"
    main(
        [
            "flow-control",
            "--loads",
            "0.5,2",
            "--variants",
            variants,
            "--duration",
            "6",
            "--epp-replicas",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads((tmp_path / "flow-control.json").read_text())
    assert data["capacity_rps"] > 0
    assert [(r["load"], r["variant"]) for r in data["runs"]] == [
        (0.5, "no flow control"),
        (0.5, "least-attained-service"),
        (2.0, "no flow control"),
        (2.0, "least-attained-service"),
        (2.0, "las + prefill limit, K=2 per-replica tokens"),
        (2.0, "las + prefill limit, K=2 pool-wide tokens"),
    ]
    for run in data["runs"]:
        assert set(run["tenants"]) == {"A", "B", "batch"}
    assert sum(t["requests"] for t in data["runs"][3]["tenants"].values()) > 0
    without = data["runs"][2]["tenants"]
    assert all(t["queue_p99_ms"] in (0.0, None) and t["shed"] == 0 for t in without.values())
    assert set(data["goals"]) == {
        "least-attained-service",
        "las + prefill limit, K=2 per-replica tokens",
        "las + prefill limit, K=2 pool-wide tokens",
    }
    markdown = (tmp_path / "flow-control.md").read_text()
    assert "| 2× | least-attained-service | B |" in markdown and "## Goals at 2× load" in markdown
    assert (tmp_path / "flow-control.png").stat().st_size > 0


def test_an_unknown_variant_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["flow-control", "--variants", "strict-priority", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--variants and --replica-variant must be among" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["flow-control", "--replica-variant", "strict-priority", "--out", str(tmp_path)])
    assert exit_.value.code == 2


def test_backlog_growth_is_zero_while_the_pool_keeps_up_and_the_excess_rate_when_not() -> None:
    def record(n: int, arrival: float, finish: float | None) -> SimulatedRequest:
        return SimulatedRequest(
            f"r{n}", f"A-{n}", "A", 0, arrival, 100, 10, first_token=finish, finish=finish
        )

    kept_up = [record(n, n * 0.1 + 0.01, n * 0.1 + 0.05) for n in range(100)]
    assert backlog_growth(kept_up, 10.0) == 0.0
    # From t=5 on, 10 req/s arrive and none finishes: the backlog grows by 10 per second.
    falling_behind = kept_up[:50] + [record(n, n * 0.1 + 0.01, None) for n in range(50, 100)]
    assert backlog_growth(falling_behind, 10.0) == pytest.approx(50 / 5, abs=0.2)
