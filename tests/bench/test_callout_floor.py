"""The callout floor's ext_authz servicer and report (the measuring itself is timed: run
``llm-epp-bench callout-floor``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from bench.runs import callout_floor
from bench.runs.callout_floor import FloorSettings, serve_authz
from sim.processes import free_port


async def test_the_authz_floor_picks_each_target_in_turn() -> None:
    grpc_port, authz_port = free_port(), free_port()
    server = asyncio.create_task(serve_authz(grpc_port, authz_port, ["10.0.0.1:1", "10.0.0.2:2"]))
    try:
        for _ in range(50):
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", authz_port)
                break
            await asyncio.sleep(0.05)
        picks = []
        for _ in range(3):
            writer.write(
                b"POST /ext-authz/v1/completions HTTP/1.1\r\nHost: epp\r\ncontent-length: 2\r\n\r\n{}"
            )
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            picks.append(
                next(line.split(": ")[1] for line in head.split("\r\n") if line.startswith("x-gateway"))
            )
        assert picks == ["10.0.0.1:1", "10.0.0.2:2", "10.0.0.1:1"]
        writer.close()
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


def test_the_report_gives_each_callouts_floor(tmp_path: Path, monkeypatch) -> None:
    cells = [
        {"callout": "ext-proc", "requests": 1500, "servicer_us": 1158.0, "envoy_us": 959.0},
        {"callout": "ext-authz", "requests": 1500, "servicer_us": 93.0, "envoy_us": 919.0},
    ]
    monkeypatch.setattr(callout_floor, "measure", lambda settings: cells)
    callout_floor.run(tmp_path, FloorSettings())
    report = (tmp_path / "callout_floor.md").read_text()
    assert "| ext-proc | 1,158 | 959 |" in report and "| ext-authz | 93 | 919 |" in report
    assert json.loads((tmp_path / "callout_floor.json").read_text())["cells"] == cells
