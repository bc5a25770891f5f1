"""``llm-epp-bench prediction-floor``: the copy's error, its best factor, the router's error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.runs.prediction_floor import Triple, best_factor, summarize


def test_the_best_factor_is_what_later_arrivals_add_on_average() -> None:
    """Every request took 1.5x what its copy said: the copy is 1/3 off, times 1.5 exact."""
    triples = [Triple(1.5 * x, x, None, "p") for x in (0.1, 0.2, 0.4)]
    factor, error = best_factor(triples)  # type: ignore[misc]
    assert factor == pytest.approx(1.5, rel=0.01) and error < 0.01
    summary = summarize(triples)
    assert summary["foreseen_mape"] == pytest.approx(1 / 3)
    assert summary["predicted_mape"] is None and summary["predicted_requests"] == 0


def test_the_routers_error_is_over_the_requests_it_predicted() -> None:
    triples = [Triple(1.0, 1.0, 2.0, "fast"), Triple(1.0, 0.5, None, "slow"), Triple(2.0, 2.0, 1.0, "slow")]
    summary = summarize(triples)
    assert summary["predicted_requests"] == 2
    assert summary["predicted_mape"] == pytest.approx(0.75)
    assert summary["foreseen_mape_on_predicted"] == 0.0
    assert summary["by_profile"]["fast"] == {"foreseen_mape": 0.0, "predicted_mape": 1.0}


def test_a_short_run_writes_json_markdown_and_a_figure(tmp_path: Path) -> None:
    argv = ["prediction-floor", "--workload", "mooncake-conversation-spread"]
    argv += ["--profile", "llama-3.1-8b-h100"]
    argv += ["--replicas", "2", "--limit", "40", "--rate-scale", "4", "--router", "round-robin"]
    main([*argv, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "prediction-floor.json").read_text())
    ttft = data["ttft"]
    assert ttft["requests"] > 0 and 0 <= ttft["foreseen_mape"] < 1
    assert ttft["best_factor_mape"] <= ttft["foreseen_mape"]
    assert ttft["predicted_requests"] == 0  # round-robin predicts nothing
    assert "| TTFT |" in (tmp_path / "prediction-floor.md").read_text()
    assert (tmp_path / "prediction-floor.png").stat().st_size > 0


def test_an_unknown_router_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["prediction-floor", "--router", "nope", "--out", str(tmp_path)])
