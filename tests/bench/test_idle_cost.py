"""``llm-epp-bench idle``: its arithmetic, report, stub engines and command line (no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.cli import main
from bench.harness.stub_engine import stub_engine_bootstrap
from bench.runs import idle_cost
from epp.datalayer.engine_metrics import parse_engine_metrics
from epp.datalayer.served_models import parse_max_model_len


def test_the_rate_is_cpu_milliseconds_per_wall_second() -> None:
    assert idle_cost.ms_per_s(2.0, 2.25, 5.0) == pytest.approx(50.0)


def routes(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    config = chain["filters"][0]["typed_config"]["route_config"]
    assert config["max_direct_response_body_size_bytes"] >= idle_cost.VLLM_SCRAPE.stat().st_size
    (host,) = config["virtual_hosts"]
    return {r["match"]["prefix"]: r["direct_response"] for r in host["routes"]}


def test_the_stub_engines_serve_the_vllm_scrape_and_a_context_length() -> None:
    scrape = idle_cost.VLLM_SCRAPE.read_text()
    served = routes(stub_engine_bootstrap([8100], scrape))
    body = served["/metrics"]["body"]["inline_string"]
    assert body == scrape and len(body) > 50_000
    assert parse_engine_metrics(body.encode(), 0.0).waiting == 0
    assert parse_max_model_len(served["/v1/models"]["body"]["inline_string"].encode()) == 4096


def test_the_report_has_a_row_per_reading(tmp_path: Path) -> None:
    results = [
        {"arm": arm, "endpoints": n, "ms_per_s": rate, "load_1m_before": 0.2}
        for arm, n, rate in [("idle tick", 4, 30.0), ("fast tick", 4, 45.5), ("idle tick", 100, 40.0)]
    ]
    loaded = [{"arm": "idle tick", "samples": 400, "mean_ms": 25.1, "p99_ms": 50.4, "max_ms": 53.2}]
    data = {
        "machine": {"cpus": 2, "date": "today"},
        "settings": {"idle_s": 10, "settle_s": 3, "loaded_rate": 40.0, "loaded_endpoints": 4},
        "results": results,
        "loaded": loaded,
    }
    markdown = idle_cost._markdown(data)
    assert "| fast tick | 4 | 45.5 | 0.20 |" in markdown and "| idle tick | 100 | 40.0 | 0.20 |" in markdown
    assert "| idle tick | 400 | 25.1 | 50.4 | 53.2 |" in markdown
    assert idle_cost._plot(data, tmp_path) == "idle.png" and (tmp_path / "idle.png").stat().st_size > 0


def test_the_command_line_passes_pool_sizes_and_duration(monkeypatch, tmp_path: Path) -> None:
    seen: list[idle_cost.IdleSettings] = []
    monkeypatch.setattr(idle_cost, "run", lambda out, settings: seen.append(settings))
    main(["idle", "--pool-sizes", "2,8", "--idle-s", "1.5", "--out", str(tmp_path)])
    assert seen == [idle_cost.IdleSettings(pool_sizes=(2, 8), idle_s=1.5)]
    with pytest.raises(SystemExit):
        main(["idle", "--pool-sizes", "0"])


def test_ages_are_summarised_in_milliseconds() -> None:
    ages = [0.001 * i for i in range(100, 0, -1)]  # 100 down to 1 ms
    assert idle_cost.age_summary(ages) == {"mean_ms": 50.5, "p99_ms": 99.0, "max_ms": 100.0}
