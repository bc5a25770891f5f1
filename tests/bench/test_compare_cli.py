"""``llm-epp-bench compare`` end to end on a tiny workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.runs.mixed import POOLS
from sim.engine.pool import pool_profiles, pool_size


def test_compare_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = [
        {"session_id": f"s{i}", "arrival_s": i * 0.2, "input_tokens": 300 + 50 * i, "output_tokens": 20}
        for i in range(6)
    ] + [{"session_id": "s0", "think_s": 0.5, "input_tokens": 900, "output_tokens": 10, "prefix": "previous"}]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    main(
        [
            "compare",
            "--workload",
            f"session-trace:{trace}",
            "--routers",
            "random,gie-default,oracle",
            "--replicas",
            "2",
            "--rate-scales",
            "1,2",
            "--out",
            str(out),
        ]
    )
    data = json.loads((out / "compare-session-trace.json").read_text())
    assert data["profile"]["name"] == "llama-3.1-8b-h100" and data["settings"]["seed"] == 0
    assert [(r["rate_scale"], r["router"]) for r in data["runs"]] == [
        (scale, router) for scale in (1.0, 2.0) for router in ("random", "gie-default", "oracle")
    ]
    assert all(r["completed"] == 7 and r["rejected"] == 0 for r in data["runs"])
    report = (out / "compare-session-trace.md").read_text()
    assert "llama-3.1-8b-h100" in report and "Seed 0" in report and "| oracle |" in report
    for name in ("cdf-x1", "cdf-x2", "load-cv", "hit-rate"):
        assert (out / f"compare-session-trace-{name}.png").stat().st_size > 1000


def test_compare_rejects_unknown_routers(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["compare", "--workload", "rl-stragglers", "--routers", "nope", "--out", str(tmp_path)])


def test_compare_runs_each_router_on_estimated_counts_too(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = [{"session_id": "s0", "arrival_s": 0.0, "input_tokens": 800, "output_tokens": 20}] + [
        {
            "session_id": "s0",
            "think_s": 0.2,
            "input_tokens": 800 + 400 * t,
            "output_tokens": 20,
            "prefix": "previous",
        }
        for t in range(1, 4)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = ["compare", "--workload", f"session-trace:{trace}", "--routers", "gie-default", "--replicas", "2"]
    main([*args, "--estimated-tokens", "3,4", "--calibrated-estimates", "--out", str(out)])
    data = json.loads((out / "compare-session-trace.json").read_text())
    labels = ["gie-default", *(f"gie-default~{kind}{b}" for kind in ("est", "cal") for b in (3, 4))]
    assert [r["router"] for r in data["runs"]] == labels
    assert all(r["completed"] == 4 for r in data["runs"])
    assert "| gie-default~est3 |" in (out / "compare-session-trace.md").read_text()


def test_compare_runs_a_mixed_pool_and_reports_each_profiles_share(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    rows = [
        {"session_id": f"s{i}", "arrival_s": i * 0.1, "input_tokens": 2000, "output_tokens": 20}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    pool = "llama-3.1-8b-h100:1,llama-3.1-8b-a100+max_num_seqs=64:2"
    argv = ["compare", "--workload", f"session-trace:{trace}", "--routers", "random", "--out", str(out)]
    main([*argv, "--profile", pool])
    data = json.loads((out / "compare-session-trace.json").read_text())
    assert data["settings"]["replicas"] == 3
    assert [(p["name"], p["replicas"]) for p in data["pool"]] == [
        ("llama-3.1-8b-h100", 1),
        ("llama-3.1-8b-a100+max_num_seqs=64", 2),
    ]
    shares = {name: row["share"] for name, row in data["runs"][0]["by_profile"].items()}
    assert sum(shares.values()) == pytest.approx(1.0) and len(shares) == 2
    assert {"predictor_ttft_mape_first_200", "predictor_ttft_mape_after_200"} <= set(
        data["runs"][0]["by_profile"]["llama-3.1-8b-h100"]
    )
    main([*argv, "--profile", pool, "--joins-at-s", "100,100"])  # both A100s join after the last arrival
    late = json.loads((out / "compare-session-trace.json").read_text())["runs"][0]["by_profile"]
    assert (
        late["llama-3.1-8b-h100"]["share"] == 1.0
        and late["llama-3.1-8b-a100+max_num_seqs=64"]["share"] == 0.0
    )
    assert (
        "llama-3.1-8b-a100+max_num_seqs=64** (2 replicas)" in (out / "compare-session-trace.md").read_text()
    )
    with pytest.raises(SystemExit):  # the pool has 3 replicas
        main([*argv, "--profile", pool, "--replicas", "4"])
    with pytest.raises(SystemExit):
        main([*argv, "--profile", "llama-3.1-8b-h100:2,nope:1"])
    with pytest.raises(SystemExit):  # someone must be there from the start
        main([*argv, "--profile", pool, "--joins-at-s", "1,1,1"])


def test_the_mixed_benchmarks_pools_load_and_differ_in_speed_and_config() -> None:
    for pool in POOLS.values():
        profiles = pool_profiles(pool, pool_size(pool) or 0)
        assert len(profiles) == 4 and len({p.name for p in profiles}) == 2
        assert profiles[-1].cost.step_time(0, 0, 8, 8000, 0.1) > 2 * profiles[0].cost.step_time(
            0, 0, 8, 8000, 0.1
        )


@pytest.mark.parametrize("hint", ["noisy", "noisy:0", "noisy:x", "exactly", "noisy:9"])
def test_compare_rejects_a_malformed_output_hint(tmp_path: Path, hint: str) -> None:
    with pytest.raises(SystemExit):
        main(
            [
                "compare",
                "--workload",
                "rl-stragglers",
                "--routers",
                "oracle",
                "--output-hint",
                hint,
                "--out",
                str(tmp_path),
            ]
        )


def test_compare_records_the_output_hint(tmp_path: Path) -> None:
    args = [
        "compare",
        "--workload",
        "rl-stragglers",
        "--limit",
        "1",
        "--replicas",
        "2",
        "--routers",
        "oracle",
    ]
    main([*args, "--output-hint", "noisy:0.5", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "compare-rl-stragglers.json").read_text())
    assert data["settings"]["output_hint_sigma"] == 0.5
