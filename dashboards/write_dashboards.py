"""Writes the generated dashboards into the chart: ``python -m dashboards.write_dashboards``.

The chart ships the files (Helm cannot run Python); a test fails when they differ from what
this writes, so edit :mod:`dashboards.panels` and rerun this, never the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dashboards import cloud_monitoring, grafana

CHART_FILES = Path(__file__).resolve().parents[1] / "charts" / "llm-epp" / "files"
GRAFANA_FILE = "grafana-dashboard.json"
CLOUD_MONITORING_FILE = "cloud-monitoring-dashboard.json"


def rendered() -> dict[str, str]:
    """File name → the text it must hold."""
    dashboards: dict[str, dict[str, Any]] = {
        GRAFANA_FILE: grafana.dashboard_json(),
        CLOUD_MONITORING_FILE: cloud_monitoring.dashboard_json(),
    }
    return {name: json.dumps(data, indent=2, sort_keys=True) + "\n" for name, data in dashboards.items()}


def main() -> None:
    for name, text in rendered().items():
        (CHART_FILES / name).write_text(text)
        print(f"wrote {CHART_FILES / name}")


if __name__ == "__main__":
    main()
