"""The trainer's bearer token and bind rules, in process (the network side: tests/integration/
test_sidecar_exposure.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from predictor.server import create_app as predictor_app
from predictor.settings import PredictorSettings
from tests.support import sample_value
from tests.trainer.running import started
from tests.trainer.synthetic import training_samples
from trainer.server import create_app
from trainer.settings import TrainerSettings
from wire.auth import BearerToken, TokenFileError, is_loopback
from wire.webapp import probe_app

TOKEN = "s3cr3t-token"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # as a Secret created with a trailing newline
    return path


def test_sidecars_bind_loopback_by_default(tmp_path: Path) -> None:
    assert TrainerSettings(model_dir=tmp_path).host == "127.0.0.1"
    assert PredictorSettings(trainer_url="http://127.0.0.1:1").host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "trainer.example"])
def test_binding_beyond_loopback_needs_a_token(tmp_path: Path, host: str) -> None:
    with pytest.raises(ValidationError, match="--auth-token-file"):
        TrainerSettings(model_dir=tmp_path, host=host)
    TrainerSettings(model_dir=tmp_path, host=host, auth_token_file=tmp_path / "token")


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.9.9.9", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "trainer.example"]))


def test_bearer_token_accepts_only_the_exact_header() -> None:
    token = BearerToken(TOKEN)
    assert token.allows(f"Bearer {TOKEN}")
    for header in (None, "", TOKEN, f"bearer {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Basic x"):
        assert not token.allows(header), header


async def test_the_mutating_route_needs_the_token(tmp_path: Path, token_file: Path) -> None:
    settings = TrainerSettings(
        model_dir=tmp_path / "models", retrain_interval_s=3600, auth_token_file=token_file
    )
    async for client, service in started(settings):
        body = {"entries": training_samples(5)}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = await client.post("/add_training_data_bulk", json=body, headers=headers)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"] == "Bearer"
            assert "Bearer" in refused.json()["detail"]
        assert service.data_status()["models"]["ttft"]["added_total"] == 0
        ok = await client.post(
            "/add_training_data_bulk", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert (ok.status_code, ok.json()) == (202, {"accepted": 5})
        assert (await client.post("/retrain")).status_code == 401
        retrain = await client.post("/retrain", headers={"Authorization": f"Bearer {TOKEN}"})
        assert retrain.status_code == 202
        text = (await client.get("/metrics")).text
        assert sample_value(text, "trainer_rejected_requests_total", reason="unauthorized") == 3.0
        # Reads and probes stay open: what they give away is the model, not control of routing.
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/data/status")).status_code == 200


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(TokenFileError, match="is empty"):
        create_app(TrainerSettings(model_dir=tmp_path / "models", auth_token_file=empty))


@pytest.mark.parametrize("which", ["trainer", "predictor"])
async def test_the_probe_app_serves_health_readiness_and_metrics_only(tmp_path: Path, which: str) -> None:
    app = (
        create_app(TrainerSettings(model_dir=tmp_path / "models"))
        if which == "trainer"
        else predictor_app(PredictorSettings(trainer_url="http://127.0.0.1:1"))
    )
    probes = probe_app(app)
    transport = httpx.ASGITransport(app=probes)
    async with httpx.AsyncClient(transport=transport, base_url="http://probes") as client:
        assert (await client.get("/healthz")).status_code == 200
        # The trainer is not ready until its app's lifespan runs; the predictor has no model yet.
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503 and readyz.json()["detail"]
        # The sidecar's own metrics, for Prometheus (read-only).
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert f"# TYPE {which}_model_version gauge" in metrics.text
        assert (await client.post("/metrics")).status_code == 405
        closed = [
            ("POST", "/add_training_data_bulk"),
            ("POST", "/retrain"),
            ("GET", "/status"),
            ("POST", "/predict/bulk"),
            ("GET", "/model/ttft/download"),
            ("GET", "/docs"),
        ]
        for method, path in closed:
            assert (await client.request(method, path)).status_code == 404, path


def test_a_missing_token_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read token file"):
        create_app(TrainerSettings(model_dir=tmp_path / "models", auth_token_file=tmp_path / "absent"))
