"""The shipped dashboards (generated from dashboards.panels) and alert rules."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from bench.harness.observed_stack import system_binary
from dashboards import cloud_monitoring, grafana
from dashboards.panels import ROWS, all_queries
from dashboards.write_dashboards import CHART_FILES, rendered

HERE = Path(__file__).parent


def test_chart_files_are_what_the_generator_writes() -> None:
    for name, text in rendered().items():
        assert (CHART_FILES / name).read_text() == text, (
            f"{name} is stale: run `python -m dashboards.write_dashboards`"
        )


def test_grafana_dashboard_has_every_panel_and_query_on_the_datasource_variable() -> None:
    data = grafana.dashboard_json()
    panels = [p for p in data["panels"] if p["type"] == "timeseries"]
    assert [p["title"] for p in panels] == [panel.title for row in ROWS for panel in row.panels]
    assert [t["expr"] for p in panels for t in p["targets"]] == [q.expr for q in all_queries()]
    assert {p["datasource"] for p in panels} == {"${datasource}"}
    assert [v["name"] for v in data["templating"]["list"]] == ["datasource"]
    assert len({p["id"] for p in data["panels"]}) == len(data["panels"])
    assert [r["title"] for r in data["panels"] if r["type"] == "row"] == [row.title for row in ROWS]


def _overlaps(a: dict, b: dict, x: str, y: str, w: str, h: str) -> bool:
    return a[x] < b[x] + b[w] and b[x] < a[x] + a[w] and a[y] < b[y] + b[h] and b[y] < a[y] + a[h]


def test_grafana_panels_tile_the_grid_without_overlap() -> None:
    boxes = [p["gridPos"] for p in grafana.dashboard_json()["panels"]]
    assert all(b["x"] + b["w"] <= 24 for b in boxes)
    assert not any(_overlaps(a, b, "x", "y", "w", "h") for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_cloud_monitoring_dashboard_has_every_query_in_a_mosaic_without_overlap() -> None:
    data = cloud_monitoring.dashboard_json()
    tiles = data["mosaicLayout"]["tiles"]
    queries = [
        s["timeSeriesQuery"]["prometheusQuery"]
        for t in tiles
        if "xyChart" in t["widget"]
        for s in t["widget"]["xyChart"]["dataSets"]
    ]
    assert queries == [q.expr for q in all_queries()]
    assert all(t["xPos"] + t["width"] <= data["mosaicLayout"]["columns"] for t in tiles)
    assert not any(
        _overlaps(a, b, "xPos", "yPos", "width", "height")
        for i, a in enumerate(tiles)
        for b in tiles[i + 1 :]
    )
    legends = {
        s["legendTemplate"]
        for t in tiles
        if "xyChart" in t["widget"]
        for s in t["widget"]["xyChart"]["dataSets"]
    }
    assert "TTFT ${metric.labels.model_name}" in legends and not any("{{" in legend for legend in legends)


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    promtool = system_binary("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(CHART_FILES / "alerts.yaml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    tested = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yaml"], cwd=HERE, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_promtool_case() -> None:
    rules = yaml.safe_load((CHART_FILES / "alerts.yaml").read_text())["groups"][0]["rules"]
    cases = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    firing = {
        step["alertname"] for case in cases for step in case["alert_rule_test"] if step.get("exp_alerts")
    }
    assert firing == {rule["alert"] for rule in rules}
