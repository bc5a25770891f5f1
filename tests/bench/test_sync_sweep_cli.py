"""``llm-epp-bench sync-sweep`` end to end on a tiny sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main


def test_sync_sweep_writes_the_k_by_d_grid_with_the_goal(tmp_path: Path) -> None:
    out = tmp_path / "out"
    main(
        [
            "sync-sweep",
            "--workloads",
            "rl-stragglers:2:2:1",
            "--routers",
            "ray-kv-aware",
            "--router-replicas",
            "1,4",
            "--sync-delays-ms",
            "50,none",
            "--out",
            str(out),
        ]
    )
    data = json.loads((out / "sync-sweep.json").read_text())
    assert [(r["router_replicas"], r["sync_delay_ms"]) for r in data["runs"]] == [
        (1, None),
        (4, 50.0),
        (4, None),
    ]
    assert data["workloads"]["rl-stragglers"]["engines"] == 2
    assert all(r["router"] == "ray-kv-aware" and r["rejected"] == 0 for r in data["runs"])
    assert len({r["completed"] for r in data["runs"]}) == 1  # every run replays the same requests
    [goal] = data["goal"]
    assert (goal["workload"], goal["router"]) == ("rl-stragglers", "ray-kv-aware")
    base, synced = data["runs"][0], data["runs"][1]
    assert goal["e2e_p99_change"] == pytest.approx(synced["e2e_ms"]["p99"] / base["e2e_ms"]["p99"] - 1)
    report = (out / "sync-sweep.md").read_text()
    assert "| ray-kv-aware | 4 | 50 ms |" in report and "| ray-kv-aware | 4 | no sync |" in report
    assert (out / "sync-sweep.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "arguments",
    [
        ["--routers", "oracle"],
        ["--workloads", "nope"],
        ["--workloads", "rl-stragglers:fast"],
        ["--workloads", "rl-stragglers:1:0"],
        ["--sync-delays-ms", "-5"],
        ["--sync-delays-ms", "soon"],
        ["--router-replicas", "0"],
    ],
)
def test_sync_sweep_refuses_bad_options(tmp_path: Path, arguments: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sync-sweep", *arguments, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
