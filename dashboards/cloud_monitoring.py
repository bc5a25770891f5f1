"""The Cloud Monitoring dashboard (PromQL tiles over Managed Service for Prometheus), from
:mod:`dashboards.panels`; ``gcloud monitoring dashboards create --config-from-file``
takes it as is."""

from __future__ import annotations

import re
from typing import Any

from dashboards.panels import ROWS, Panel, Query

COLUMNS, TILE_WIDTH, TILE_HEIGHT = 48, 16, 16
# Grafana units → the UCUM units Cloud Monitoring's unitOverride takes.
UNITS = {"percentunit": "10^2.%", "s": "s", "reqps": "1/s", "short": "1"}


def _legend(query: Query) -> str:
    return re.sub(r"\{\{(\w+)\}\}", r"${metric.labels.\1}", query.legend)


def _widget(panel: Panel) -> dict[str, Any]:
    return {
        "title": panel.title,
        "xyChart": {
            "chartOptions": {"mode": "COLOR"},
            "dataSets": [
                {
                    "plotType": "LINE",
                    "legendTemplate": _legend(q),
                    "targetAxis": "Y1",
                    "timeSeriesQuery": {"prometheusQuery": q.expr, "unitOverride": UNITS[panel.unit]},
                }
                for q in panel.queries
            ],
            "yAxis": {"scale": "LINEAR"},
        },
    }


def dashboard_json() -> dict[str, Any]:
    """A mosaic layout: each row a full-width section header, then its panels three across."""
    tiles: list[dict[str, Any]] = []
    y = 0
    for row in ROWS:
        tiles.append(
            {"xPos": 0, "yPos": y, "width": COLUMNS, "height": 4,
             "widget": {"title": row.title, "sectionHeader": {"subtitle": "", "dividerBelow": True}}}
        )  # fmt: skip
        y += 4
        per_line = COLUMNS // TILE_WIDTH
        for i, panel in enumerate(row.panels):
            tiles.append(
                {"xPos": (i % per_line) * TILE_WIDTH, "yPos": y + (i // per_line) * TILE_HEIGHT,
                 "width": TILE_WIDTH, "height": TILE_HEIGHT, "widget": _widget(panel)}
            )  # fmt: skip
        y += -(-len(row.panels) // per_line) * TILE_HEIGHT
    return {"displayName": "llm-epp", "mosaicLayout": {"columns": COLUMNS, "tiles": tiles}}
