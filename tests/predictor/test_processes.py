"""The real processes on loopback: a trainer, a predictor pulling over HTTP, one reading the directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sim.processes import BIN, Component, free_port, http_ok, spawn, wait_until
from tests.trainer.synthetic import feature_rows, training_samples

pytestmark = pytest.mark.integration


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[Component]]:
    started: list[Component] = []
    yield started
    for component in started:
        component.stop()


def model_version(url: str) -> int | None:
    return httpx.get(f"{url}/status", timeout=2).json()["model_version"]


def test_trainer_to_predictors_hot_reload(tmp_path: Path, processes: list[Component]) -> None:
    model_dir, logs = tmp_path / "models", tmp_path / "logs"
    logs.mkdir()
    trainer_port, http_port, dir_port = free_port(), free_port(), free_port()
    trainer_url = f"http://127.0.0.1:{trainer_port}"
    common = ["--host", "127.0.0.1", "--poll-interval-s", "0.2", "--log-level", "warning"]
    trainer = spawn(
        "trainer",
        [
            str(BIN / "llm-epp-trainer"),
            "--host",
            "127.0.0.1",
            "--port",
            str(trainer_port),
            "--model-dir",
            str(model_dir),
            "--retrain-interval-s",
            "0.3",
            "--min-samples",
            "100",
            "--n-estimators",
            "50",
        ],
        logs,
    )
    processes.append(trainer)
    wait_until(trainer, http_ok(f"{trainer_url}/readyz"))
    pulling = spawn(
        "predictor-http",
        [str(BIN / "llm-epp-predictor"), "--port", str(http_port), "--trainer-url", trainer_url, *common],
        logs,
    )
    reading = spawn(
        "predictor-dir",
        [str(BIN / "llm-epp-predictor"), "--port", str(dir_port), "--model-dir", str(model_dir), *common],
        logs,
    )
    processes += [pulling, reading]
    predictor_urls = [f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{dir_port}"]
    for component, url in zip((pulling, reading), predictor_urls, strict=True):
        wait_until(component, http_ok(f"{url}/healthz"))
        assert httpx.get(f"{url}/readyz").status_code == 503  # no model yet

    response = httpx.post(
        f"{trainer_url}/add_training_data_bulk", json={"entries": training_samples(500, seed=1)}
    )
    assert response.status_code == 202
    for component, url in zip((pulling, reading), predictor_urls, strict=True):
        wait_until(component, http_ok(f"{url}/readyz"))

    rows = feature_rows(100)
    answers = [
        httpx.post(f"{url}/predict/bulk/strict", json={"requests": rows}).json() for url in predictor_urls
    ]
    assert answers[0]["model_version"] == answers[1]["model_version"] == 1
    assert [p["ttft_ms"] for p in answers[0]["predictions"]] == [
        p["ttft_ms"] for p in answers[1]["predictions"]
    ]

    httpx.post(f"{trainer_url}/add_training_data_bulk", json={"entries": training_samples(500, seed=2)})
    for component, url in zip((pulling, reading), predictor_urls, strict=True):
        wait_until(component, lambda url=url: (model_version(url) or 0) >= 2)
    assert httpx.get(f"{predictor_urls[0]}/status").json()["counts"]["model_load_failures"] == 0
