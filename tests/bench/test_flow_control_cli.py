"""``llm-epp-bench flow-control`` end to end on a short overload: the files, the tenant table, the
goals, and a clear error for an unknown variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


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
    ]
    for run in data["runs"]:
        assert set(run["tenants"]) == {"A", "B", "batch"}
    assert sum(t["requests"] for t in data["runs"][3]["tenants"].values()) > 0
    without = data["runs"][2]["tenants"]
    assert all(t["queue_p99_ms"] in (0.0, None) and t["shed"] == 0 for t in without.values())
    assert set(data["goals"]) == {"least-attained-service"}
    markdown = (tmp_path / "flow-control.md").read_text()
    assert "| 2× | least-attained-service | B |" in markdown and "## Goals at 2× load" in markdown
    assert (tmp_path / "flow-control.png").stat().st_size > 0


def test_an_unknown_variant_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["flow-control", "--variants", "strict-priority", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--variants must be among" in capsys.readouterr().err
