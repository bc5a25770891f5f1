"""``llm-epp-bench mixed`` end to end on a short slice of the trace: each pool's capacity is
measured, the runs are at the asked fractions of it, and the summary has every router's row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.runs.mixed import POOLS


def test_mixed_runs_every_router_at_fractions_of_each_pools_measured_capacity(tmp_path: Path) -> None:
    argv = ["mixed", "--limit", "60", "--routers", "round-robin,oracle", "--loads", "0.5,0.9"]
    main([*argv, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "mixed.json").read_text())
    assert [p["label"] for p in data["pools"]] == list(POOLS)
    for pool in data["pools"]:
        capacity = pool["capacity_rate_scale"]
        assert capacity > 0
        assert [(r["load"], r["router"]) for r in pool["rows"]] == [
            (load, router) for load in (0.5, 0.9) for router in ("round-robin", "oracle")
        ]
        assert [r["rate_scale"] for r in pool["rows"]] == pytest.approx(
            [0.5 * capacity] * 2 + [0.9 * capacity] * 2, rel=1e-3
        )
        by_router = {r["router"]: r for r in pool["rows"] if r["load"] == 0.5}
        assert by_router["round-robin"]["slow_share"] > by_router["oracle"]["slow_share"] >= 0
        assert (tmp_path / pool["label"] / "compare-mooncake-conversation-spread.json").is_file()
    markdown = (tmp_path / "mixed.md").read_text()
    assert "## 2fast-2slow" in markdown and "| oracle |" in markdown
    assert (tmp_path / "mixed.png").stat().st_size > 0


def test_an_unknown_router_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["mixed", "--routers", "gie-default,nope", "--out", str(tmp_path)])
