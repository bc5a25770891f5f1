"""Benchmark output: machine-readable JSON, a Markdown report, and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from sim.processes import envoy_binary


def machine() -> dict[str, Any]:
    envoy = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "envoy": envoy.rsplit("version:", 1)[-1].strip(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def cell(value: Any, digits: int = 0) -> str:
    """A table cell: numbers with thousands separators and ``digits`` decimals, "–" for missing."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def style_latency_cdfs(axes: Sequence[Any]) -> None:
    """Label three CDF panels of TTFT, TPOT and E2E (log-scale seconds), legend on the first."""
    for axis, title in zip(axes, ("TTFT (s)", "TPOT (s)", "E2E (s)"), strict=True):
        axis.set_xscale("log")
        axis.set_xlabel(title)
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(markdown + "\n")
    return json_path, md_path


def save_figure(figure: Figure, out_dir: Path, name: str) -> str:
    """Write ``figure`` as ``out_dir/name``, release it, and return ``name``."""
    figure.tight_layout()
    figure.savefig(out_dir / name, dpi=110)
    plt.close(figure)
    return name
