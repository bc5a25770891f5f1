"""Predicted latency as the plugins share it: what the predicted-latency producer writes for the
other plugins to read (the predictor's interface: ``epp.scheduling.predictor``)."""

from __future__ import annotations

from dataclasses import dataclass

from epp.scheduling.framework import DataKey
from wire.latency import FeatureRowDict


@dataclass(frozen=True, slots=True)
class EndpointPrediction:
    """Predicted latency of one request on one endpoint, and its SLO headroom (ms).

    Headroom is ``SLO − prediction``: positive means the endpoint is predicted to meet the
    objective. With no TTFT SLO its headroom is ``−prediction``, so the lowest prediction has
    the most. ``tpot_headroom_ms`` is None where no TPOT objective binds.
    """

    ttft_ms: float
    tpot_ms: float
    ttft_headroom_ms: float
    tpot_headroom_ms: float | None

    @property
    def meets_slo(self) -> bool:
        return self.ttft_headroom_ms >= 0 and (self.tpot_headroom_ms is None or self.tpot_headroom_ms >= 0)


@dataclass(slots=True)
class LatencyPredictions:
    """Per-endpoint predictions for one request (only endpoints that got one), plus the SLOs."""

    by_endpoint: dict[str, EndpointPrediction]
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    tpot_applies: bool = False
    """TPOT matters for this request (a streaming request under a streaming-mode model)."""
    model_version: int | None = None
    """The model version that predicted them, where the predictor says."""
    constant_targets: tuple[str, ...] = ()
    """The targets that version predicts by a constant (``Prediction.constant_targets``)."""

    @property
    def has_slo(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_tpot_ms is not None


LATENCY_PREDICTIONS: DataKey[LatencyPredictions] = DataKey("latency-predictions")
PREDICTION_FALLBACK: DataKey[str] = DataKey("latency-prediction-fallback")
"""Why this request has no predictions (``disabled``, ``timeout``, ``breaker_open``, ...)."""
DRIFTED_PREDICTIONS: DataKey[LatencyPredictions] = DataKey("latency-predictions-drifted")
"""Predictions made while the model drifts (``epp.latency.drift``): kept to measure its error,
never routed on (``LATENCY_PREDICTIONS`` is absent and the fallback reason is ``drift``)."""
FEATURE_ROWS: DataKey[dict[str, FeatureRowDict]] = DataKey("latency-feature-rows")
"""Each endpoint's feature row as it was at scheduling time (written even when predictions are
off or fail), kept so the request can be trained on once it finishes."""
