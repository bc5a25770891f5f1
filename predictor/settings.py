"""The prediction server's one configuration model. Command-line flags map onto it one to one."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PredictorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address to bind (loopback: only its own pod reaches it)")
    port: int = Field(8001, ge=0, le=65535, description="HTTP port")
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve /healthz, /readyz and /metrics alone on this port, all interfaces",
    )
    trainer_url: str | None = Field(
        None, description="pull models from this training server (e.g. http://127.0.0.1:8000)"
    )
    model_dir: Path | None = Field(None, description="or read them from the trainer's model directory")
    poll_interval_s: float = Field(5.0, gt=0.0, description="how often to look for a new model version")
    fetch_timeout_s: float = Field(30.0, gt=0.0, description="time limit of one manifest or model download")
    predict_threads: int = Field(1, ge=1, le=256, description="xgboost threads per prediction call")
    max_rows: int = Field(10_000, ge=1, le=1_000_000, description="most rows one prediction call may carry")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="larger request bodies get 413")

    @model_validator(mode="after")
    def _one_source(self) -> PredictorSettings:
        if (self.trainer_url is None) == (self.model_dir is None):
            raise ValueError("give exactly one model source: trainer_url or model_dir")
        return self
