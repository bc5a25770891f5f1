"""``llm-epp-bench sync-sweep`` end to end on a tiny sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.workloads import traces

SLICES = Path(__file__).parents[1] / "fixtures" / "traces"


def test_sync_sweep_writes_the_k_by_d_grid_with_the_goal_over_seeds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    main(
        [
            "sync-sweep",
            "--workloads",
            "rl-stragglers:1:2:1",
            "--routers",
            "ray-kv-aware",
            "--router-replicas",
            "1,4",
            "--sync-delays-ms",
            "0,50",
            "--seeds",
            "0,1",
            "--out",
            str(out),
        ]
    )
    data = json.loads((out / "sync-sweep.json").read_text())
    assert [(r["seed"], r["router_replicas"], r["sync_delay_ms"]) for r in data["runs"]] == [
        (seed, k, d) for seed in (0, 1) for k, d in ((1, None), (4, 0.0), (4, 50.0))
    ]
    assert data["workloads"]["rl-stragglers"]["engines"] == 2
    assert all(r["router"] == "ray-kv-aware" and r["rejected"] == 0 for r in data["runs"])
    for seed in (0, 1):  # within a seed, every run replays the same requests
        assert len({r["completed"] for r in data["runs"] if r["seed"] == seed}) == 1

    def p99(seed: int, k: int, d: float | None, metric: str) -> float:
        [run] = [
            r for r in data["runs"] if (r["seed"], r["router_replicas"], r["sync_delay_ms"]) == (seed, k, d)
        ]
        return run[metric]["p99"]

    def mean(k: int, d: float | None, metric: str) -> float:
        return (p99(0, k, d, metric) + p99(1, k, d, metric)) / 2

    [goal] = data["goal"]
    assert (goal["workload"], goal["router"], goal["seeds"]) == ("rl-stragglers", "ray-kv-aware", 2)
    assert goal["e2e_p99_change"] == pytest.approx(mean(4, 50.0, "e2e_ms") / mean(1, None, "e2e_ms") - 1)
    assert goal["ttft_p99_change"] == pytest.approx(mean(4, 50.0, "ttft_ms") / mean(1, None, "ttft_ms") - 1)
    assert goal["noise_ttft_p99_change"] == pytest.approx(
        mean(4, 0.0, "ttft_ms") / mean(1, None, "ttft_ms") - 1
    )
    per_seed = sorted(p99(s, 4, 50.0, "ttft_ms") / p99(s, 1, None, "ttft_ms") - 1 for s in (0, 1))
    assert goal["ttft_p99_change_range"] == pytest.approx(per_seed)
    report = (out / "sync-sweep.md").read_text()
    assert "| ray-kv-aware | 4 | 50 ms |" in report and "| ray-kv-aware | 4 | 0 ms |" in report
    assert f"{mean(1, None, 'e2e_ms') / 1e3:.2f} |" in report  # cells show the seeds' mean
    assert (out / "sync-sweep.png").stat().st_size > 1000


def test_sync_sweep_replays_mooncake_with_spread_arrivals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traces, "TRACES_DIR", SLICES)
    out = tmp_path / "out"
    arguments = ["--workloads", "mooncake-conversation-spread:1:2:60", "--routers", "gie-default"]
    main(["sync-sweep", *arguments, "--router-replicas", "1,2", "--sync-delays-ms", "50", "--out", str(out)])
    data = json.loads((out / "sync-sweep.json").read_text())
    workload = data["workloads"]["mooncake-conversation-spread"]
    assert (workload["engines"], workload["limit"]) == (2, 60)
    assert "arrivals spread over their ~3 s buckets" in workload["description"]
    assert [(r["router_replicas"], r["completed"]) for r in data["runs"]] == [(1, 60), (2, 60)]


def test_sync_sweep_takes_its_engines_from_a_mixed_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traces, "TRACES_DIR", SLICES)
    out = tmp_path / "out"
    pool = "llama-3.1-8b-h100:1,llama-3.1-8b-a100:2"
    arguments = ["--workloads", "mooncake-conversation-spread:1:2:30", "--routers", "gie-default"]
    main(["sync-sweep", *arguments, "--router-replicas", "1", "--profile", pool, "--out", str(out)])
    data = json.loads((out / "sync-sweep.json").read_text())
    assert data["workloads"]["mooncake-conversation-spread"]["engines"] == 3
    assert [(p["name"], p["replicas"]) for p in data["pool"]] == [
        ("llama-3.1-8b-h100", 1),
        ("llama-3.1-8b-a100", 2),
    ]
    assert set(data["runs"][0]["by_profile"]) == {"llama-3.1-8b-h100", "llama-3.1-8b-a100"}


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
        ["--seeds", "1,1"],
        ["--seeds", "x"],
        ["--profile", "llama-3.1-8b-h100:2,nope:2"],
        ["--profile", "llama-3.1-8b-h100+slowdown=0"],
    ],
)
def test_sync_sweep_refuses_bad_options(tmp_path: Path, arguments: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sync-sweep", *arguments, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
