"""Trace readers and workload builders on small slices of the real traces."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from bench.workloads import traces
from bench.workloads.fleet_workloads import WorkloadOptions, build_workload, spread_over_buckets

SLICES = Path(__file__).parents[1] / "fixtures" / "traces"


@pytest.fixture(autouse=True)
def trace_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real rows from the repository's slices of the public traces, wherever it is checked out."""
    monkeypatch.setattr(traces, "TRACES_DIR", SLICES)


def test_mooncake_rows_and_prefix_blocks() -> None:
    rows = traces.read_mooncake(traces.trace_path(traces.MOONCAKE["conversation"]), limit=50)
    assert len(rows) == 50
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in rows)
    assert rows[0].hash_ids[0] == 0 and rows[0].arrival_s == 0.0  # the universal system block
    workload = build_workload("mooncake-conversation", WorkloadOptions(scale=2.0, limit=50))
    assert workload.num_requests == 50
    last = workload.sessions[-1]
    assert last.start_s == pytest.approx(rows[-1].arrival_s / 2)
    assert last.turns[0].prefix == "blocks" and last.turns[0].hash_ids == rows[-1].hash_ids


def test_spread_arrivals_stay_in_their_buckets() -> None:
    stamps = [0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 8.0, 8.0]
    spread = spread_over_buckets(stamps, random.Random(1))
    ends = {0.0: 3.0, 3.0: 6.0, 6.0: 8.0, 8.0: 11.0}  # the last bucket: the median width, 3 s
    assert all(t <= s < ends[t] for t, s in zip(stamps, spread, strict=True))
    assert len(set(spread)) == len(stamps)
    assert spread == spread_over_buckets(stamps, random.Random(1))
    assert spread_over_buckets([], random.Random(1)) == []


def test_mooncake_spread_keeps_requests_and_breaks_the_bursts() -> None:
    options = WorkloadOptions(limit=200, seed=3)
    recorded = build_workload("mooncake-conversation", options)
    spread = build_workload("mooncake-conversation-spread", options)
    assert [s.turns for s in spread.sessions] == [s.turns for s in recorded.sessions]
    starts = [s.start_s for s in recorded.sessions]
    assert len(set(starts)) < len(starts) // 5  # the trace stamps ~3 s buckets
    assert len({s.start_s for s in spread.sessions}) == len(starts)
    pairs = zip(recorded.sessions, spread.sessions, strict=True)
    assert all(0 <= b.start_s - a.start_s < 3.01 for a, b in pairs)
    other_seed = build_workload("mooncake-conversation-spread", WorkloadOptions(limit=200, seed=4))
    assert other_seed.sessions != spread.sessions


def test_mooncake_prompts_are_clipped_to_the_window() -> None:
    workload = build_workload("mooncake-synthetic", WorkloadOptions(limit=300, max_model_len=8192))
    assert workload.params["clipped"] > 0
    assert all(t.input_tokens + t.output_tokens <= 8192 for s in workload.sessions for t in s.turns)


def test_azure_rows_are_relative_and_load_only() -> None:
    rows = traces.read_azure(traces.trace_path(traces.AZURE["code"]), limit=20)
    assert rows[0].arrival_s == 0.0 and all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(rows))
    workload = build_workload("azure-conv", WorkloadOptions(limit=20))
    assert {t.prefix for s in workload.sessions for t in s.turns} == {"none"}


def test_agentic_sessions_grow_and_fit_the_window() -> None:
    workload = build_workload("agentic-weka", WorkloadOptions(limit=6, seed=3, max_model_len=32768))
    starts = [s.start_s for s in workload.sessions]
    assert starts == sorted(starts) and len(set(starts)) == 6
    for session in workload.sessions:
        assert session.turns[0].prefix == "none"
        for previous, turn in itertools.pairwise(session.turns):
            assert turn.input_tokens + turn.output_tokens <= 32768
            assert turn.think_s <= 30.0
            if turn.prefix == "previous":  # the previous prompt, then (part of) its answer and new tokens
                assert turn.input_tokens >= previous.input_tokens
    # The traces' prompts extend the previous turn's in 97% of turns (README of the traces).
    turns = [t for s in workload.sessions for t in s.turns[1:]]
    assert sum(t.prefix == "previous" for t in turns) >= 0.8 * len(turns)


def test_rl_stragglers_steps() -> None:
    workload = build_workload("rl-stragglers", WorkloadOptions(limit=2))
    assert workload.num_requests == 2 * 2 * 8 * 10  # trainers x steps x rollouts x turns
    first_step = [s for s in workload.sessions if s.group == "t0-step0"]
    assert len(first_step) == 8 and all(s.after is None for s in first_step)
    assert sum(s.turns[-1].output_tokens == 8192 for s in first_step) == 2
    assert {s.turns[0].hash_ids for s in first_step} == {first_step[0].turns[0].hash_ids}  # shared prompt
    assert {s.after for s in workload.sessions if s.group == "t0-step1"} == {"t0-step0"}
    assert build_workload("rl-stragglers", WorkloadOptions(limit=1, scale=3.0)).params["trainers"] == 6


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_session_trace_format(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "trace.jsonl",
        [
            {"session_id": "a", "arrival_s": 1.0, "input_tokens": 100, "output_tokens": 5},
            {
                "session_id": "a",
                "think_s": 2.0,
                "input_tokens": 150,
                "output_tokens": 5,
                "prefix": "previous",
            },
            {
                "session_id": "b",
                "arrival_s": 3.0,
                "input_tokens": 600,
                "output_tokens": 7,
                "hash_ids": [1, 2],
            },
            {"session_id": "a", "arrival_s": 9.0, "input_tokens": 10, "output_tokens": 1},
        ],
    )
    workload = build_workload(f"session-trace:{path}", WorkloadOptions(scale=2.0))
    a, b = workload.sessions
    assert (a.start_s, b.start_s) == (0.5, 1.5)
    assert [t.prefix for t in a.turns] == ["none", "previous", "none"]
    assert (a.turns[1].offset_s, a.turns[1].think_s) == (None, 2.0)
    assert a.turns[2].offset_s == pytest.approx(4.0)
    assert b.turns[0].prefix == "blocks" and b.turns[0].hash_ids == (1, 2)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"session_id": "a", "input_tokens": 1, "output_tokens": 1}, "needs arrival_s"),
        ({"session_id": "a", "arrival_s": 0, "input_tokens": 0, "output_tokens": 1}, "input_tokens"),
        ({"session_id": "a", "arrival_s": 0, "input_tokens": 9, "output_tokens": 1, "x": 1}, "unknown"),
        (
            {"session_id": "a", "arrival_s": 0, "input_tokens": 900, "output_tokens": 1, "hash_ids": [1]},
            "cover",
        ),
    ],
)
def test_session_trace_errors_name_the_line(tmp_path: Path, row: dict, message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(traces.TraceError, match=message) as error:
        traces.read_session_trace(path)
    assert "bad.jsonl:1" in str(error.value)
