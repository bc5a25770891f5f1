"""The live replay on a small stack: a 10-request Mooncake slice, and a report made of what came back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.runs import live_replay
from bench.runs.live_replay import ReplaySettings
from bench.workloads import traces

pytestmark = pytest.mark.integration

SLICES = Path(__file__).parents[1] / "fixtures" / "traces"


def _sliced_replay(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> ReplaySettings:
    """A 30-second replay of the committed mooncake-conversation slice on two instant replicas."""
    monkeypatch.setattr(traces, "TRACES_DIR", SLICES)
    return ReplaySettings(
        workload="mooncake-conversation", duration_s=30.0, profile="instant", replicas=2, **overrides
    )


def test_a_short_replay_reports_what_the_stack_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _sliced_replay(monkeypatch, configs=("gie-default",), limit=10)
    workload, sessions = live_replay.build(settings)
    data = live_replay.run(settings, tmp_path, (workload, sessions))

    (result,) = data["results"]
    records = result["records"]
    assert (result["requests"], result["completed"], result["errors"]) == (10, 10, {})
    planned = {s.session_id: s.turns[0] for s in sessions}
    for record in records:
        turn = planned[record["session_id"]]
        assert record["prompt_tokens"] == turn.prompt_tokens  # the texts tokenize as planned
        assert record["completion_tokens"] == turn.output_tokens  # ignore_eos: the trace's length
        assert 0 < record["ttft_s"] <= record["e2e_s"]
    assert result["prompt_tokens"] == sum(t.prompt_tokens for t in planned.values())
    # Cached tokens as the responses report them are the engines' own prefix-cache hits.
    assert result["hit_rate_client"] == result["hit_rate_engines"]
    assert result["cached_tokens"] >= 0 and result["hit_rate_engines"] is not None
    assert sum(result["requests_per_replica"]) == 10
    assert result["epp"]["requests"] == 10 and result["epp"]["predicted_share"] is None
    # Every output token took an engine step, so one request alone needs as many steps as its tokens.
    assert result["step_lag"]["all"]["steps"] >= max(r["completion_tokens"] for r in records)
    assert len(result["step_lag"]["per_replica"]) == 2
    cpu = result["cpu_s"]
    assert set(cpu) == {"envoy", "epp", "replica-0", "replica-1", "client"}
    assert cpu["epp"] > 0 and cpu["replica-0"] + cpu["replica-1"] > 0
    ttft = sorted(r["ttft_s"] * 1e3 for r in records)
    assert ttft[0] <= result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"] <= ttft[-1]

    written = json.loads((tmp_path / "replay-mooncake-conversation.json").read_text())
    assert written["results"][0]["ttft_ms"] == result["ttft_ms"]
    markdown = (tmp_path / "replay-mooncake-conversation.md").read_text()
    assert "| gie-default | 10/10 | 0 |" in markdown
    for name in ("cdf", "stack"):
        assert (tmp_path / f"replay-mooncake-conversation-{name}.png").stat().st_size > 10_000


def test_configs_side_by_side_each_get_their_own_stack_at_the_same_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _sliced_replay(monkeypatch, configs=("gie-default", "round-robin"), limit=6, side_by_side=True)
    data = live_replay.run(settings, tmp_path)
    gie, round_robin = data["results"]
    assert (gie["config"], round_robin["config"]) == ("gie-default", "round-robin")
    for result in (gie, round_robin):
        assert (result["requests"], result["completed"]) == (6, 6)
        assert result["epp"]["requests"] == 6  # each EPP saw its own six requests, not the other's
        assert sum(result["requests_per_replica"]) == 6
        assert {r["endpoint"] for r in result["records"]} <= {"replica-0", "replica-1"}
    assert [r["endpoint"] for r in round_robin["records"]].count("replica-0") == 3  # it alternates
    assert "ran side by side" in (tmp_path / "replay-mooncake-conversation.md").read_text()


def test_rounds_replay_the_configs_in_turn_each_on_a_fresh_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _sliced_replay(monkeypatch, configs=("gie-default", "round-robin"), limit=4, rounds=2)
    data = live_replay.run(settings, tmp_path)
    runs = [(r["round"], r["config"]) for r in data["results"]]
    assert runs == [(1, "gie-default"), (1, "round-robin"), (2, "gie-default"), (2, "round-robin")]
    for result in data["results"]:
        # A fresh stack each run: its EPP and replicas counted only that run's four requests.
        assert (result["completed"], result["epp"]["requests"], sum(result["requests_per_replica"])) == (
            4,
            4,
            4,
        )
        assert result["load_average"]["samples"] >= 1 and result["load_average"]["mean"] >= 0.0
    markdown = (tmp_path / "replay-mooncake-conversation.md").read_text()
    assert "## 2 rounds: each config against the round's first" in markdown
    assert "| round-robin #2 | 4/4 | 0 |" in markdown
