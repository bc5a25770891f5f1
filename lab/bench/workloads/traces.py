"""Readers of the public request traces in ``../shared/traces`` and of the generic session-trace format.

Each reader returns plain rows; ``bench.workloads.fleet_workloads`` turns them into simulator workloads.

Session-trace format (``--workload session-trace:PATH``), one JSON object per line::

    {"session_id": "a", "arrival_s": 0.0, "input_tokens": 2000, "output_tokens": 150}
    {"session_id": "a", "think_s": 3.5, "input_tokens": 2600, "output_tokens": 80, "prefix": "previous"}
    {"session_id": "b", "arrival_s": 1.2, "input_tokens": 9000, "output_tokens": 40,
     "hash_ids": [0, 7, 8], "hash_block_tokens": 512}

* ``session_id`` (string) groups rows into sessions; rows of a session are its turns, in file order.
* ``input_tokens`` / ``output_tokens`` (integers >= 1): prompt length and tokens to generate.
* When the turn arrives: ``arrival_s``, seconds from the start of the replay (open loop; the
  session's first row must have one), or ``think_s``, seconds after the session's previous turn
  finished (closed loop).
* Prefix relation (``prefix``): ``none`` (default: fresh tokens, shared with nothing),
  ``previous`` (the previous turn's prompt and generated output, then fresh tokens up to
  ``input_tokens``), or implied by ``hash_ids``: the prompt is the token blocks named by the ids
  (``hash_block_tokens`` each, default 512, one value per file), cut to ``input_tokens``; equal ids
  are equal tokens, so shared leading ids are a shared prefix (as in the Mooncake traces).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

TRACES_DIR = Path(os.environ.get("LLM_EPP_TRACES", Path(__file__).resolve().parents[4] / "shared" / "traces"))
"""Where the public traces are (``LLM_EPP_TRACES`` overrides)."""
MOONCAKE = {
    "conversation": "mooncake/conversation_trace.jsonl",
    "synthetic": "mooncake/synthetic_trace.jsonl",
}
AZURE = {
    "conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
}
WEKA = "weka_cc_traces/cc-traces-weka-no-subagents-051226_head5000.jsonl"


class TraceError(ValueError):
    """A trace file is missing or malformed; the message names the file and line."""


def trace_path(relative: str) -> Path:
    path = TRACES_DIR / relative
    if not path.is_file():
        raise TraceError(f"trace {path} not found (the shared traces live in {TRACES_DIR})")
    return path


@dataclass(frozen=True, slots=True)
class MooncakeRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: Path, limit: int | None = None) -> list[MooncakeRow]:
    """Rows of a Mooncake trace (``timestamp`` in ms, ``hash_ids`` of 512-token blocks)."""
    rows = []
    for number, item in _json_lines(path, limit):
        try:
            rows.append(
                MooncakeRow(
                    item["timestamp"] / 1000.0,
                    int(item["input_length"]),
                    int(item["output_length"]),
                    tuple(item["hash_ids"]),
                )
            )
        except (KeyError, TypeError) as exc:
            raise TraceError(f"{path}:{number}: not a Mooncake row: {exc!r}") from None
    return rows


@dataclass(frozen=True, slots=True)
class AzureRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int


def read_azure(path: Path, limit: int | None = None) -> list[AzureRow]:
    """Rows of an Azure LLM inference trace, arrival times relative to the first row."""
    rows: list[AzureRow] = []
    start: datetime | None = None
    with path.open(newline="") as handle:
        for number, item in enumerate(csv.DictReader(handle), start=2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                stamp = datetime.strptime(item["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
                start = start or stamp
                rows.append(
                    AzureRow(
                        (stamp - start).total_seconds(),
                        int(item["ContextTokens"]),
                        int(item["GeneratedTokens"]),
                    )
                )
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{path}:{number}: not an Azure row: {exc!r}") from None
    return rows


@dataclass(frozen=True, slots=True)
class WekaRow:
    session_id: str
    turn_index: int
    input_tokens: int
    output_tokens: int
    think_s: float


def read_weka(path: Path) -> dict[str, list[WekaRow]]:
    """Turns of each Claude Code session, in turn order."""
    sessions: dict[str, list[WekaRow]] = {}
    for number, item in _json_lines(path, None):
        try:
            row = WekaRow(
                item["session_id"],
                int(item["turn_index"]),
                int(item["input_tokens"]),
                int(item["output_tokens"]),
                float(item.get("think_time_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{number}: not a Weka row: {exc!r}") from None
        sessions.setdefault(row.session_id, []).append(row)
    for turns in sessions.values():
        turns.sort(key=lambda row: row.turn_index)
    return sessions


@dataclass(frozen=True, slots=True)
class SessionTraceRow:
    session_id: str
    input_tokens: int
    output_tokens: int
    arrival_s: float | None
    think_s: float | None
    prefix: str
    hash_ids: tuple[int, ...]
    hash_block_tokens: int


def read_session_trace(path: Path) -> list[SessionTraceRow]:
    """Rows of a session-trace JSONL file (format in the module docstring), validated."""
    rows: list[SessionTraceRow] = []
    seen: set[str] = set()
    block_sizes: set[int] = set()
    for number, item in _json_lines(path, None):
        where = f"{path}:{number}"
        try:
            session = item["session_id"]
            input_tokens, output_tokens = item["input_tokens"], item["output_tokens"]
        except KeyError as exc:
            raise TraceError(f"{where}: missing field {exc}") from None
        if not isinstance(session, str) or not session:
            raise TraceError(f"{where}: session_id must be a non-empty string")
        for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TraceError(f"{where}: {name} must be an integer >= 1")
        arrival, think = item.get("arrival_s"), item.get("think_s")
        if session not in seen and arrival is None:
            raise TraceError(f"{where}: the first row of session {session!r} needs arrival_s")
        if (arrival is None) == (think is None) and session in seen:
            raise TraceError(f"{where}: give exactly one of arrival_s and think_s")
        for name, value in (("arrival_s", arrival), ("think_s", think)):
            if value is not None and (not isinstance(value, int | float) or value < 0):
                raise TraceError(f"{where}: {name} must be a number >= 0")
        hash_ids = item.get("hash_ids", ())
        prefix = "blocks" if hash_ids else item.get("prefix", "none")
        if prefix not in ("none", "previous", "blocks"):
            raise TraceError(f"{where}: prefix must be 'none' or 'previous'")
        block = item.get("hash_block_tokens", 512)
        if hash_ids:
            if not all(isinstance(h, int) for h in hash_ids) or len(hash_ids) * block < input_tokens:
                raise TraceError(f"{where}: hash_ids must be integers covering input_tokens")
            block_sizes.add(block)
        unknown = set(item) - {
            "session_id",
            "input_tokens",
            "output_tokens",
            "arrival_s",
            "think_s",
            "prefix",
            "hash_ids",
            "hash_block_tokens",
        }
        if unknown:
            raise TraceError(f"{where}: unknown fields {sorted(unknown)}")
        seen.add(session)
        rows.append(
            SessionTraceRow(
                session, input_tokens, output_tokens, arrival, think, prefix, tuple(hash_ids), block
            )
        )
    if len(block_sizes) > 1:
        raise TraceError(f"{path}: hash_block_tokens differs between rows: {sorted(block_sizes)}")
    return rows


def _json_lines(path: Path, limit: int | None) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open() as handle:
        count = 0
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(item, dict):
                raise TraceError(f"{path}:{number}: not a JSON object")
            count += 1
            yield number, item
