"""The EPP process's one configuration model. Command-line flags map onto it one to one."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from epp.tokenization import TINY_MODEL_DIR


class EppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("0.0.0.0", description="address every EPP server binds")
    grpc_port: int = Field(9002, ge=0, le=65535, description="ext_proc gRPC port")
    health_port: int = Field(9003, ge=0, le=65535, description="gRPC health port (liveness, readiness)")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics port")
    pool_name: str = Field("local-pool", description="pool name in metrics labels")
    endpoints_file: Path = Field(description="static endpoints YAML, reloaded on change")
    endpoints_poll_s: float = Field(1.0, gt=0, description="how often the endpoints file is checked")
    config: str = Field("gie-default", description="EndpointPickerConfig: a shipped name or a YAML path")
    tokenizer_dir: Path = Field(
        TINY_MODEL_DIR, description="model dir with tokenizer.json + tokenizer_config.json"
    )
    scrape_interval_s: float = Field(0.05, gt=0, description="engine /metrics polling period")
    scrape_timeout_s: float = Field(1.0, gt=0, description="engine /metrics request timeout")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="larger request bodies get 413")
    kv_events_staleness_s: float = Field(
        5.0, gt=0, description="a busy engine silent this long falls back to the approximate index"
    )
    kv_events_replay_timeout_s: float = Field(2.0, gt=0, description="wait for a KV-events replay answer")
    seed: int | None = Field(None, description="seed for the scheduling RNG (random if unset)")
    predictor_url: list[str] = Field(
        default_factory=list, description="predictor sidecar base URLs (repeat the flag or comma-separate)"
    )
    trainer_url: str | None = Field(None, description="trainer sidecar base URL, for training samples")
    prediction_timeout_ms: float = Field(400.0, gt=0, le=10_000, description="time box of one prediction")
    prediction_coalesce_ms: float = Field(
        1.0, ge=0, le=100, description="window merging concurrent predictions"
    )
