"""Pictures of the dashboards without a Grafana: ``python -m bench.runs.dashboard_preview --out DIR``.

Runs the observed stack (:mod:`bench.harness.observed_stack`) under load for ``--seconds``, then writes

- ``live-page.png``: headless Chromium's screenshot of the EPP's ``/dashboard``;
- ``dashboard-panels.png``: every panel of :mod:`dashboards.panels` (what the Grafana and
  Cloud Monitoring dashboards show), plotted with matplotlib from Prometheus' ``query_range``
  over the run, in the dashboards' rows and with their legends. Grafana's own rendering is not
  reproduced (no Grafana runs here); the queries and the data are the same.
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.harness.observed_stack import observed_stack, run_chromium
from dashboards.panels import ROWS, Panel

COLUMNS = 3
# Grafana unit → (scale, axis label) for the plots.
UNITS = {"percentunit": (100.0, "%"), "s": (1e3, "ms"), "reqps": (1.0, "per s"), "short": (1.0, "")}


def query_range(
    prometheus_url: str, expr: str, start: float, end: float, step_s: float
) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{prometheus_url}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step_s},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["data"]["result"]


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), ""), template)


def _plot_panel(axes: Any, panel: Panel, prometheus_url: str, start: float, end: float) -> None:
    scale, unit = UNITS[panel.unit]
    step = max(1.0, (end - start) / 200)
    for query in panel.queries:
        for series in query_range(prometheus_url, query.expr, start, end, step):
            points = [
                (float(t) - start, float(v) * scale) for t, v in series["values"] if math.isfinite(float(v))
            ]
            if points:
                axes.plot(
                    *zip(*points, strict=True), label=_legend(query.legend, series["metric"]), linewidth=1.2
                )
    axes.set_title(panel.title, fontsize=9, loc="left")
    axes.set_ylabel(unit, fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(alpha=0.3)
    if axes.has_data():
        axes.legend(fontsize=6, loc="upper left")


def plot_panels(prometheus_url: str, start: float, end: float, path: Path) -> None:
    """Every row's panels, ``COLUMNS`` across, x in seconds since ``start``."""
    lines = [math.ceil(len(row.panels) / COLUMNS) for row in ROWS]
    figure = plt.figure(figsize=(15, 2.8 * sum(lines) + 0.4 * len(ROWS)))
    for row, subfigure, count in zip(
        ROWS, figure.subfigures(len(ROWS), 1, height_ratios=lines), lines, strict=True
    ):
        subfigure.suptitle(row.title, x=0.01, ha="left", fontsize=11, fontweight="bold")
        grid = subfigure.subplots(count, COLUMNS, squeeze=False)
        for i, axes in enumerate(grid.flat):
            if i < len(row.panels):
                _plot_panel(axes, row.panels[i], prometheus_url, start, end)
            else:
                axes.set_visible(False)
    figure.supxlabel("seconds since the load started", fontsize=9)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to run the load")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="dashboard-preview-") as tmp,
        observed_stack(Path(tmp)) as observed,
    ):
        start = time.time()
        time.sleep(args.seconds)
        page, panels = args.out.resolve() / "live-page.png", args.out / "dashboard-panels.png"
        run_chromium(
            observed.page_url, Path(tmp) / "chromium", "--window-size=1400,1150",
            "--virtual-time-budget=3000", f"--screenshot={page}",
        )  # fmt: skip
        plot_panels(observed.prometheus_url, start, time.time(), panels)
        print(f"wrote {page} and {panels} after {observed.load.sent} requests")


if __name__ == "__main__":
    main()
