"""Dashboards, alerts and the live page against a running stack under load.

A real Prometheus (Debian's package) scrapes every process of a stack with two synced EPP
replicas, the trainer, a predictor and two simulated engines while clients send requests with
SLOs (some impossible to meet) and a few that fail. Then every panel query of the shipped
dashboards and every alert expression must return data, and name only metrics the stack
exports. The live page is loaded in real headless Chromium twice, and its numbers must move.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench.harness.observed_stack import ObservedStack, observed_stack, run_chromium
from dashboards.panels import all_queries
from tests.observability.prometheus import as_signal, exported_names, metric_names, query
from tests.stacks import CheckedStack
from tests.support import wait_for

pytestmark = pytest.mark.integration
ALERTS = Path(__file__).resolve().parents[2] / "charts" / "llm-epp" / "files" / "alerts.yaml"


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return {rule["alert"]: rule["expr"] for rule in rules}


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStack]:
    workdir = tmp_path_factory.mktemp("observability")
    with observed_stack(workdir, CheckedStack, ["--verify-tokenizer-cache"]) as running:
        yield running


def _without_data(prometheus_url: str, exprs: dict[str, str]) -> dict[str, str]:
    """The expressions (by name) that return no series now."""
    return {name: expr for name, expr in exprs.items() if not query(prometheus_url, expr)}


def test_every_panel_query_and_alert_expression_returns_data(observed: ObservedStack) -> None:
    exprs = {f"panel query {q.legend!r}: {q.expr}": q.expr for q in all_queries()}
    exprs |= {f"alert {name}": as_signal(expr) for name, expr in alert_exprs().items()}
    empty: dict[str, str] = dict(exprs)

    def all_have_data() -> bool:
        empty.clear()
        empty.update(_without_data(observed.prometheus_url, exprs))
        return not empty

    # The trainer's first model (and so predictions) needs samples first: up to a minute here.
    assert wait_for(all_have_data, timeout=120), "no data yet for:\n" + "\n".join(empty)
    assert observed.load.sent > 50


def test_queries_name_only_metrics_the_stack_exports(observed: ObservedStack) -> None:
    assert wait_for(lambda: "trainer_model_mape" in exported_names(observed.prometheus_url), timeout=120)
    exported = exported_names(observed.prometheus_url)
    named = set().union(
        *(metric_names(q.expr) for q in all_queries()), *map(metric_names, alert_exprs().values())
    )
    assert named - exported == set()
    # The check is not vacuous: it parses names out of real queries, and one we do not export
    # (a typo of a real name) fails it and has no data.
    assert {"inference_pool_ready_pods", "vllm:prefix_cache_hits_total"} <= named
    typo = "sum (rate(llm_epp_prediction_fallbacks_total[5m]))"
    assert metric_names(typo) - exported == {"llm_epp_prediction_fallbacks_total"}
    assert query(observed.prometheus_url, typo) == []


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after Chromium ran its scripts for a few (virtual) seconds, less the scripts."""
    dom = run_chromium(url, profile, "--virtual-time-budget=3000", "--dump-dom").stdout
    return re.sub(r"<script>.*?</script>", "", dom, flags=re.S)  # its source is not the page


def _text(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match is not None, f"no #{element_id} in the page"
    return match.group(1)


def _page_numbers(dom: str) -> tuple[int, list[str], int, int]:
    """Finished requests, endpoint rows, decision rows, points on the measured-TTFT line."""
    endpoints = re.findall(r'<tr data-endpoint="([^"]+)"', dom)
    decisions = dom.split('id="decisions"', 1)[1].count("<details>")
    actual = re.search(r'id="actual-line"[^>]*points="([^"]*)"', dom)
    assert actual is not None, "the TTFT chart was not drawn"
    return int(_text(dom, "finished")), endpoints, decisions, len(actual.group(1).split())


def test_live_page_renders_in_chromium_and_moves_under_load(observed: ObservedStack) -> None:
    page = observed.page_url
    data_url = f"{page}/data"
    assert wait_for(lambda: httpx.get(data_url, timeout=5).json()["totals"]["finished"] > 0, timeout=60)

    first = dump_dom(page, observed.workdir / "chromium-1")
    assert _text(first, "status") == "live"
    finished, endpoints, decisions, points = _page_numbers(first)
    assert finished > 0 and decisions > 0 and points > 0
    assert sorted(endpoints) == sorted(e["name"] for e in httpx.get(data_url, timeout=5).json()["endpoints"])
    assert len(endpoints) == 2

    assert wait_for(
        lambda: httpx.get(data_url, timeout=5).json()["totals"]["finished"] > finished + 5, timeout=60
    )
    later, _, _, _ = _page_numbers(dump_dom(page, observed.workdir / "chromium-2"))
    assert later > finished, "the page's request count did not move under load"
    # /metrics is still served on the same port.
    assert "inference_pool_ready_pods" in httpx.get(page.replace("/dashboard", "/metrics"), timeout=5).text
