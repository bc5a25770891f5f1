"""The Grafana dashboard, built with grafanalib from :mod:`dashboards.panels`."""

from __future__ import annotations

import json
from typing import Any

from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, Time, TimeSeries

from dashboards.panels import ROWS, Panel

UID = "llm-epp"
DATASOURCE = "${datasource}"
PANEL_WIDTH, PANEL_HEIGHT, GRID_WIDTH = 8, 8, 24


def _panel(panel: Panel, x: int, y: int) -> TimeSeries:
    return TimeSeries(
        title=panel.title,
        description=panel.description,
        dataSource=DATASOURCE,
        unit=panel.unit,
        gridPos=GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=x, y=y),
        targets=[
            Target(expr=q.expr, legendFormat=q.legend, refId=chr(ord("A") + i), datasource=DATASOURCE)
            for i, q in enumerate(panel.queries)
        ],
    )


def dashboard() -> Dashboard:
    """Rows in order, three panels across; a ``datasource`` variable picks the Prometheus."""
    panels: list[RowPanel | TimeSeries] = []
    y = 0
    for row in ROWS:
        panels.append(RowPanel(title=row.title, gridPos=GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        y += 1
        per_line = GRID_WIDTH // PANEL_WIDTH
        for i, panel in enumerate(row.panels):
            panels.append(_panel(panel, (i % per_line) * PANEL_WIDTH, y + (i // per_line) * PANEL_HEIGHT))
        y += -(-len(row.panels) // per_line) * PANEL_HEIGHT
    datasource = Template(name="datasource", label="Prometheus", query="prometheus", type="datasource")
    return Dashboard(
        title="llm-epp",
        uid=UID,
        description="Routing, SLOs and predictions of the llm-epp endpoint picker",
        tags=["llm-epp", "inference"],
        time=Time("now-1h", "now"),
        refresh="30s",
        schemaVersion=36,
        templating=Templating(list=[datasource]),
        panels=panels,
    ).auto_panel_ids()


def dashboard_json() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    return json.loads(json.dumps(dashboard().to_json_data(), cls=DashboardEncoder))
