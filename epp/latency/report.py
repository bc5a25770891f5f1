"""The prediction report: what the predicted-latency producer decided, as metrics and debug headers.

A lifecycle observer (``epp.requestcontrol.lifecycle``) of the live EPP: when a request is routed
it counts a prediction fallback by reason; when a request completes it observes the chosen
endpoint's predicted TTFT and TPOT; for a request that asked (``x-llm-epp-debug``) it adds the
predictions to the response headers. The fleet simulator reads the same chosen prediction
(:func:`chosen_prediction`) for its error figures.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.latency.metrics import PredictionMetrics
from epp.scheduling.framework import CycleState, RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.predictions import LATENCY_PREDICTIONS, PREDICTION_FALLBACK, EndpointPrediction


def chosen_prediction(state: CycleState, endpoint: str) -> EndpointPrediction | None:
    """The prediction for ``endpoint`` the request was routed on, if it was predicted."""
    predictions = state.get(LATENCY_PREDICTIONS)
    return predictions.by_endpoint.get(endpoint) if predictions is not None else None


class PredictionReport(LifecycleObserver):
    def __init__(self, metrics: PredictionMetrics | None) -> None:
        """``metrics``: where to count (None: debug headers only)."""
        self.metrics = metrics

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        fallback = routed.state.get(PREDICTION_FALLBACK)
        if fallback is not None and self.metrics is not None:
            self.metrics.count_fallback(fallback)

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        if not outcome.completed or self.metrics is None:
            return
        predicted = chosen_prediction(routed.state, routed.endpoint_name)
        if predicted is not None:
            self.metrics.observe_predicted(
                routed.request.model, predicted.ttft_ms / 1e3, predicted.tpot_ms / 1e3
            )

    def debug_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        state = routed.state
        headers: dict[str, str] = {}
        predictions = state.get(LATENCY_PREDICTIONS)
        if predictions is not None:
            predicted = predictions.by_endpoint.get(routed.endpoint_name)
            if predicted is not None:
                headers["x-llm-epp-predicted-ttft-ms"] = f"{predicted.ttft_ms:.3f}"
                headers["x-llm-epp-predicted-tpot-ms"] = f"{predicted.tpot_ms:.3f}"
            headers["x-llm-epp-candidates-ttft-ms"] = ",".join(
                f"{name}={p.ttft_ms:.1f}" for name, p in predictions.by_endpoint.items()
            )
        if (fallback := state.get(PREDICTION_FALLBACK)) is not None:
            headers["x-llm-epp-prediction-fallback"] = fallback
        return headers
