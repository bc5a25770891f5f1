"""The training server's one configuration model. Command-line flags map onto it one to one."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wire.auth import require_token_off_loopback
from wire.settings import HealthPort

Objective = Literal["mean", "quantile"]
TargetTransform = Literal["log", "raw"]


class TrainingSettings(BaseModel):
    """How one model is fitted and evaluated (shared by both models)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: Objective = Field(
        "mean", description="mean: reg:squarederror; quantile: reg:quantileerror at quantile_alpha"
    )
    quantile_alpha: float = Field(0.9, gt=0.0, lt=1.0, description="the quantile a quantile model predicts")
    target_transform: TargetTransform = Field(
        "log", description="fit log(latency) (relative errors) or raw milliseconds"
    )
    # 120 trees of depth 5, not the anchor's 200 of depth 6: as accurate on the predictor bench's
    # simulated traffic (seeds 1-3, two load levels) at under half the prediction cost, which is
    # most of a predictor's CPU per call (``llm-epp-bench predictor``, "Model size").
    n_estimators: int = Field(120, ge=1, le=5000, description="boosting rounds (trees)")
    max_depth: int = Field(5, ge=1, le=16, description="depth of each tree")
    learning_rate: float = Field(0.05, gt=0.0, le=1.0, description="shrinkage per tree")
    holdout_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="share of samples held out to evaluate")
    # One thread, not all cores: the windows are small (a few thousand rows) and the trainer shares
    # its machine with the engines and the EPP; on a busy 2-core box a 100-sample fit took 10 s of
    # wall time and 2.5 s of CPU on all cores, 0.25 s and 0.05 s on one.
    train_threads: int = Field(1, ge=0, le=256, description="xgboost threads while training (0: all cores)")
    # Trees do not extrapolate: a TTFT model that saw few uncached long prompts predicted a 25k-token
    # prompt with no cache faster (305-360 ms) than one with 16k cached, and the router moved such
    # turns off their cache (700-740 ms measured; llm-epp-bench replay, agentic-weka x10).
    ttft_monotone: bool = Field(
        True, description="constrain the TTFT model to rise with uncached tokens and queues (TTFT_MONOTONE)"
    )
    seed: int = Field(0, description="seed of the holdout split and of xgboost")


class TrainerSettings(TrainingSettings):
    host: str = Field(
        "127.0.0.1",
        description="address to bind; any but loopback exposes the training routes, so it needs "
        "--auth-token-file",
    )
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    health_port: HealthPort = None
    auth_token_file: Path | None = Field(
        None, description="file holding the bearer token that every mutating route then requires"
    )
    model_dir: Path = Field(Path("models"), description="where model artifacts and the manifest are written")
    retrain_interval_s: float = Field(10.0, gt=0.0, description="seconds between retraining attempts")
    # 40, not 100: until the first model the EPP routes on its heuristic, and at agentic-weka x4
    # (about 1.2 requests/s) 100 samples took 105 s of a 150 s live replay. Models fitted on small
    # windows are judged by cross-validation (trainer.training), so a lucky 4-sample holdout does
    # not publish them; on the fleet simulator (agentic-weka x4, seeds 0-2, first 150 s) 40 routed
    # 636 requests on predictions against 420 with 100, at the same TTFT.
    min_samples: int = Field(40, ge=10, description="samples a model's window needs before it is trained")
    bucket_capacity: int = Field(
        500, ge=1, le=100_000, description="samples kept per window bucket (of each endpoint class)"
    )
    keep_versions: int = Field(3, ge=1, le=100, description="model versions kept on disk")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="larger request bodies get 413")

    @model_validator(mode="after")
    def _exposed_needs_token(self) -> TrainerSettings:
        require_token_off_loopback(self.host, self.auth_token_file)
        return self

    def training(self) -> TrainingSettings:
        return TrainingSettings.model_validate(
            {name: getattr(self, name) for name in TrainingSettings.model_fields}
        )
