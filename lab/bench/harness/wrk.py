"""Closed-loop HTTP load from wrk (Debian's ``wrk``; ``make system-packages`` installs it).

The Python load generator (``bench.harness.loadgen``) spends about 0.3 ms of CPU per request on the same
cores as the stack it drives, which caps a 2-core machine's throughput below what the stack
serves. wrk is C, and costs a fraction of that.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = {body}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRK requests=%d errors=%d status_errors=%d seconds=%.6f p50_ms=%.3f p99_ms=%.3f\\n",
    summary.requests, e.connect + e.read + e.write + e.timeout + e.status, e.status,
    summary.duration / 1e6, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    errors: int
    """Socket errors, timeouts and non-2xx/3xx answers together."""
    status_errors: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "rps": round(self.rps, 1)}


def parse_summary(stdout: str) -> WrkResult:
    """The ``WRK ...`` line the script's ``done`` hook writes; raises if wrk wrote none."""
    line = next((s for s in stdout.splitlines() if s.startswith("WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk wrote no summary:\n{stdout}")
    fields = dict(re.findall(r"(\w+)=([\d.]+)", line))
    return WrkResult(
        requests=int(fields["requests"]),
        errors=int(fields["errors"]),
        status_errors=int(fields["status_errors"]),
        seconds=float(fields["seconds"]),
        p50_ms=float(fields["p50_ms"]),
        p99_ms=float(fields["p99_ms"]),
    )


def post(url: str, body: bytes, connections: int, seconds: int) -> WrkResult:
    """POST ``body`` (JSON) to ``url`` from ``connections`` connections on one wrk thread, for
    ``seconds`` (whole: wrk reads no fractions)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        # A JSON string with raw UTF-8 reads the same as a Lua string: its escapes (quote,
        # backslash, n, t, r, b, f) mean the same in Lua; ensure_ascii=False avoids \u (Lua has none).
        script.write_text(_SCRIPT.format(body=json.dumps(body.decode(), ensure_ascii=False)))
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30, check=True)
    return parse_summary(done.stdout)
