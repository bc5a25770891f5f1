"""``predicted-latency-producer``: predicted TTFT/TPOT of the request on every candidate.

Builds one feature row per candidate (the endpoint's scraped load, the EPP's own in-flight
token load there, the prompt length, its prefix-cache match there), makes one bulk prediction
call for all of them, and writes each
endpoint's prediction and SLO headroom (``LATENCY_PREDICTIONS``). Once the request finishes,
it sends the chosen endpoint's row, as it was at scheduling time, with the measured
latencies to the trainer: one TTFT sample and (streaming mode) one TPOT sample.

=================================  =======  ===============================================
parameter                          default  meaning
=================================  =======  ===============================================
streamingMode                      false    false: the model predicts end-to-end latency
                                            (trained on E2E; TPOT neither trained nor used).
                                            true: TTFT to the first token, TPOT counted in
                                            tokens, for streaming requests.
sloBufferFactor                    1.0      SLOs are scaled by this before taking headroom
predictionBasedSchedulingDefault   true     whether requests without an
                                            ``x-prediction-based-scheduling`` header use it
skipWhenCachedAt                   none     a prefix match at least this on an endpoint
                                            with no queue: do not predict (see below)
predictOutputsFrom                 none     predict anyway when the request's answer is
                                            estimated (``EXPECTED_OUTPUT``: a hint or
                                            learned) at this many tokens or more
driftMapeThreshold                 0.5      rolling MAPE above which the model drifts
                                            (0: never); see ``epp.latency.drift``
driftRecoverMapeThreshold          0.3      rolling MAPE at or below which drift ends
driftWindow                        100      requests the rolling error is taken over
endpointCorrection                 false    correct each endpoint's predictions by its own
                                            samples (``epp.latency.correction``)
correctionHalfLife                 20       predicted requests of an endpoint after which a
                                            correction has moved half way to its bias
endpointClassLabel                 none     the pod label whose value is the endpoint's
                                            class (accelerator, serving config), sent to the
                                            model as ``endpoint_class``; none: class 0
=================================  =======  ===============================================

TTFT headroom is ``SLO × buffer − prediction`` (``−prediction`` with no SLO, so the lowest
prediction has the most). TPOT headroom exists for streaming requests in streaming mode when
some TPOT SLO binds on the endpoint: the tightest among this request's and those of the
streaming requests already running there (a new request slows their decoding too).
When the predictor cannot answer in time, nothing is written except the reason
(``PREDICTION_FALLBACK``); consumers fall back to heuristics.

``skipWhenCachedAt`` saves the predictor round trip where the predictions would change nothing:
set to the threshold of the config's prefix-affinity filter, a request whose prompt is cached
that well on an endpoint with no waiting requests is kept there by the filter (its TTFT gate
opens only for a penalty of seconds, which an endpoint with no queue does not have; the EPP's
own bookings there, which the engine's metrics show a scrape late, go to the filter's
token-load gate instead), so it is routed without predictions (reason ``cached``); its feature
rows are still written, and it still trains the model. In the live replay of agentic-weka
sessions (rate scale 4, 150 s) that was 78% of the requests, each of which otherwise waited for
a round trip (p50 6 ms, p99 80 ms on the shared 2-core machine) whose answer no plugin used.
``predictOutputsFrom`` exempts long answers: where decoding thousands of tokens on a slow or
crowded endpoint costs more than re-prefilling the prompt elsewhere, the affinity filter's
``gateOnExpectedOutput`` needs the predictions to see it.

With ``endpointCorrection``, each endpoint's predictions are the model's times a factor learned
from that endpoint's own completed requests (``epp.latency.correction``): the model cannot tell a
slow accelerator from a fast one at the same load, and no label is needed to learn it. With
``endpointClassLabel`` (for example GKE's ``cloud.google.com/gke-accelerator``, copied onto the
pods), the model itself tells them apart: each row carries its endpoint's class code
(``wire.latency.endpoint_class_code``) and the trainer keeps each class's samples apart. An
endpoint without the label is class 0, as every endpoint is without the parameter.

Each completed request's chosen prediction and actuals feed the drift monitor (``drift``). While
the model drifts, predictions go to ``DRIFTED_PREDICTIONS`` instead, the reason is ``drift``,
and the predictor is asked once to retrain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from epp.latency.correction import EndpointCorrections
from epp.latency.drift import DriftMonitor, DriftRule
from epp.load.token_load import NO_LOAD, EndpointLoad
from epp.scheduling.config import ConfigError
from epp.scheduling.cycle_data import EXPECTED_OUTPUT, PREFIX_MATCH, TOKEN_LOAD
from epp.scheduling.framework import (
    CycleState,
    DataKey,
    DataProducer,
    Plugin,
    PluginContext,
    PluginParameters,
    PreRequest,
    RequestOutcome,
)
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.predictions import (
    DRIFTED_PREDICTIONS,
    FEATURE_ROWS,
    LATENCY_PREDICTIONS,
    PREDICTION_FALLBACK,
    EndpointPrediction,
    LatencyPredictions,
)
from epp.scheduling.predictor import LatencyPredictor, Prediction, PredictionUnavailable
from epp.scheduling.registry import register_default_producer
from epp.scheduling.types import Endpoint, EndpointState, LLMRequest, SchedulingResult
from wire.latency import FeatureRowDict, TrainingSampleDict, endpoint_class_code

log = logging.getLogger(__name__)


class PredictedLatencyParameters(PluginParameters):
    streaming_mode: bool = Field(default=False, alias="streamingMode")
    slo_buffer_factor: float = Field(default=1.0, gt=0, le=10, alias="sloBufferFactor")
    prediction_based_scheduling_default: bool = Field(default=True, alias="predictionBasedSchedulingDefault")
    skip_when_cached_at: float | None = Field(default=None, gt=0.0, le=1.0, alias="skipWhenCachedAt")
    predict_outputs_from: int | None = Field(default=None, ge=1, alias="predictOutputsFrom")
    drift_mape_threshold: float = Field(default=0.5, ge=0.0, alias="driftMapeThreshold")
    drift_recover_mape_threshold: float = Field(default=0.3, gt=0.0, alias="driftRecoverMapeThreshold")
    drift_window: int = Field(default=100, ge=5, le=100_000, alias="driftWindow")
    endpoint_correction: bool = Field(default=False, alias="endpointCorrection")
    correction_half_life: float = Field(default=20.0, gt=0, le=100_000, alias="correctionHalfLife")
    endpoint_class_label: str | None = Field(default=None, min_length=1, alias="endpointClassLabel")


RAW_PREDICTIONS: DataKey[dict[str, Prediction]] = DataKey("latency-predictions-uncorrected")
"""The model's own predictions, before each endpoint's correction (with ``endpointCorrection``)."""


def feature_row(
    request: LLMRequest, endpoint: EndpointState, prefix_score: float, load: EndpointLoad, endpoint_class: int
) -> FeatureRowDict:
    """The model's view of ``request`` on ``endpoint`` (of class ``endpoint_class``) now."""
    m = endpoint.metrics
    return FeatureRowDict(
        kv_cache_percentage=m.kv_cache_usage,
        input_token_length=request.input_tokens,
        num_request_waiting=m.waiting,
        num_request_running=m.running,
        num_tokens_generated=0,
        prefix_cache_score=prefix_score,
        pod_type="",
        prefill_tokens_in_flight=load.prefill_tokens,
        decode_tokens_in_flight=load.decode_tokens,
        endpoint_class=endpoint_class,
    )


@register_default_producer
class PredictedLatencyProducer(DataProducer, PreRequest, LifecycleObserver):
    type_name = "predicted-latency-producer"
    Parameters = PredictedLatencyParameters
    produces = (LATENCY_PREDICTIONS, FEATURE_ROWS, PREDICTION_FALLBACK)
    consumes = (PREFIX_MATCH, TOKEN_LOAD)
    reads_if_present = (EXPECTED_OUTPUT,)
    params: PredictedLatencyParameters

    def __init__(self, name: str, params: PredictedLatencyParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        if context.latency_predictor is None:
            raise ConfigError(
                f"plugin {name!r} needs a latency predictor: start the EPP with --predictor-url"
            )
        self.predictor: LatencyPredictor = context.latency_predictor
        # Streaming requests' TPOT SLOs on each endpoint, by request id.
        # Per endpoint, keyed by CycleState.key (client request ids need not be unique).
        self._running_tpot_slos: dict[str, dict[Any, float]] = {}
        self.drift = DriftMonitor(
            DriftRule(params.drift_mape_threshold, params.drift_recover_mape_threshold, params.drift_window)
        )
        self.corrections = (
            EndpointCorrections(params.correction_half_life) if params.endpoint_correction else None
        )

    def produce(self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState):
        match = state.get(PREFIX_MATCH)
        loads = state.get(TOKEN_LOAD) or {}
        rows = {
            e.name: feature_row(
                request,
                e,
                match.fraction(e.name) if match else 0.0,
                loads.get(e.name, NO_LOAD),
                self._class_of(e.endpoint),
            )
            for e in endpoints
        }
        state.put(FEATURE_ROWS, rows)
        enabled = request.prediction_based
        if enabled is None:
            enabled = self.params.prediction_based_scheduling_default
        if not enabled:
            state.put(PREDICTION_FALLBACK, "disabled")
            return None
        if self._cached_without_queue(endpoints, rows) and not self._long_answer(state):
            state.put(PREDICTION_FALLBACK, "cached")
            return None
        return self._predict(request, rows, state)

    def _class_of(self, endpoint: Endpoint) -> int:
        label = self.params.endpoint_class_label
        if label is None:
            return 0
        return endpoint_class_code(endpoint.labels.get(label, ""))

    def _cached_without_queue(
        self, endpoints: Sequence[EndpointState], rows: dict[str, FeatureRowDict]
    ) -> bool:
        threshold = self.params.skip_when_cached_at
        if threshold is None:
            return False
        return any(
            rows[e.name]["prefix_cache_score"] >= threshold and e.metrics.waiting == 0 for e in endpoints
        )

    def _long_answer(self, state: CycleState) -> bool:
        """The request's answer is estimated at ``predictOutputsFrom`` tokens or more."""
        threshold = self.params.predict_outputs_from
        if threshold is None:
            return False
        expected = state.get(EXPECTED_OUTPUT)
        return expected is not None and expected.estimated and expected.tokens >= threshold

    async def _predict(self, request: LLMRequest, rows: dict[str, FeatureRowDict], state: CycleState) -> None:
        try:
            predictions = await self.predictor.predict(list(rows.values()))
        except PredictionUnavailable as exc:
            state.put(PREDICTION_FALLBACK, exc.reason)
            return
        if self.corrections is not None:
            predictions = self._corrected(list(rows), predictions, state)
        buffer = self.params.slo_buffer_factor
        ttft_slo, tpot_slo = request.slo_ttft_ms, request.slo_tpot_ms
        tpot_applies = self.params.streaming_mode and request.stream
        by_endpoint = {}
        for name, p in zip(rows, predictions, strict=True):
            ttft_headroom = (ttft_slo * buffer if ttft_slo else 0.0) - p.ttft_ms
            tpot_headroom = None
            if tpot_applies:
                binding = [*self._running_tpot_slos.get(name, {}).values(), *([tpot_slo] if tpot_slo else [])]
                if binding:
                    tpot_headroom = min(binding) * buffer - p.tpot_ms
            by_endpoint[name] = EndpointPrediction(p.ttft_ms, p.tpot_ms, ttft_headroom, tpot_headroom)
        version = predictions[0].model_version if predictions else None
        constant = predictions[0].constant_targets if predictions else ()
        made = LatencyPredictions(by_endpoint, ttft_slo, tpot_slo, tpot_applies, version, constant)
        if self.drift.drifting:
            state.put(DRIFTED_PREDICTIONS, made)
            state.put(PREDICTION_FALLBACK, "drift")
            return
        state.put(LATENCY_PREDICTIONS, made)

    def _corrected(
        self, names: list[str], predictions: Sequence[Prediction], state: CycleState
    ) -> list[Prediction]:
        """Each endpoint's prediction times its correction; the raw ones kept to learn from."""
        corrections = self.corrections
        assert corrections is not None
        state.put(RAW_PREDICTIONS, dict(zip(names, predictions, strict=True)))
        return [
            Prediction(
                p.ttft_ms * corrections.factor(name, "ttft"),
                p.tpot_ms * corrections.factor(name, "tpot"),
                p.model_version,
                p.constant_targets,
            )
            for name, p in zip(names, predictions, strict=True)
        ]

    def _learn_correction(self, endpoint: str, state: CycleState, samples: list[TrainingSampleDict]) -> None:
        raw = state.get(RAW_PREDICTIONS)
        predicted = raw.get(endpoint) if raw is not None else None
        if self.corrections is None or predicted is None:
            return
        for sample in samples:
            self.corrections.observe(endpoint, "ttft", predicted.ttft_ms, sample["actual_ttft_ms"])
            self.corrections.observe(endpoint, "tpot", predicted.tpot_ms, sample["actual_tpot_ms"])

    @property
    def running_tpot_slos(self) -> dict[str, dict[Any, float]]:
        """Per endpoint, the TPOT SLOs of the streaming requests running there, by booking key
        (``CycleState.key`` for this replica's, (peer, key) for peers' added by ``epp.sync``)."""
        return self._running_tpot_slos

    def pre_request(self, request: LLMRequest, result: SchedulingResult, state: CycleState) -> None:
        if self.params.streaming_mode and request.stream and request.slo_tpot_ms:
            self._running_tpot_slos.setdefault(result.endpoint.name, {})[state.key] = request.slo_tpot_ms

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        result, state = routed.result, routed.state
        running = self._running_tpot_slos.get(result.endpoint.name)
        if running is not None:
            running.pop(state.key, None)
        rows = state.get(FEATURE_ROWS)
        row = rows.get(result.endpoint.name) if rows else None
        if row is None or not outcome.completed:
            return
        samples = self._samples(row, outcome)
        self.predictor.add_training(samples)
        self._measure_error(result.endpoint.name, state, samples)
        self._learn_correction(result.endpoint.name, state, samples)

    def _measure_error(self, endpoint: str, state: CycleState, samples: list[dict[str, Any]]) -> None:
        """Feed the drift monitor the chosen endpoint's predictions against the actuals the
        request trains on; ask for a retrain when the model starts to drift."""
        made = state.get(LATENCY_PREDICTIONS) or state.get(DRIFTED_PREDICTIONS)
        predicted = made.by_endpoint.get(endpoint) if made is not None else None
        if made is None or predicted is None or made.model_version is None:
            return
        now = self.context.clock()
        drifting = self.drift.drifting
        version, constant = made.model_version, made.constant_targets
        for sample in samples:
            if (ttft := sample["actual_ttft_ms"]) > 0:
                self.drift.observe("ttft", version, predicted.ttft_ms, ttft, now, "ttft" in constant)
            if (tpot := sample["actual_tpot_ms"]) > 0:
                self.drift.observe("tpot", version, predicted.tpot_ms, tpot, now, "tpot" in constant)
        if self.drift.drifting != drifting:
            event = self.drift.events[-1]
            log.warning(
                "latency model v%d %s: live %s MAPE %.0f%%",
                event.version,
                "drifts, routing on heuristics and asking for a retrain" if event.drifting else "recovered",
                event.target,
                event.mape * 100,
            )
        if self.drift.take_retrain_request():
            self.predictor.request_retrain()

    def _samples(self, row: FeatureRowDict, outcome: RequestOutcome) -> list[TrainingSampleDict]:
        now = self.context.wall_clock()
        if not self.params.streaming_mode:
            return [
                TrainingSampleDict(
                    **row, actual_ttft_ms=outcome.e2e_s * 1e3, actual_tpot_ms=0.0, timestamp=now
                )
            ]
        samples = []
        if outcome.streaming and (ttft := outcome.ttft_s) is not None:
            samples.append(
                TrainingSampleDict(**row, actual_ttft_ms=ttft * 1e3, actual_tpot_ms=0.0, timestamp=now)
            )
        if outcome.streaming and (tpot := outcome.tpot_s) is not None:
            samples.append(
                TrainingSampleDict(**row, actual_ttft_ms=0.0, actual_tpot_ms=tpot * 1e3, timestamp=now)
            )
        return samples


@runtime_checkable
class PredictsLatency(Protocol):
    """A plugin that predicts each request's latency per endpoint: its error on the endpoints it
    chose (``drift``), and the TPOT SLOs of the requests running on each endpoint, which replicas
    share: the ``predicted-latency-producer``."""

    drift: DriftMonitor

    @property
    def running_tpot_slos(self) -> dict[str, dict[Any, float]]: ...


def find_predicted_latency(plugins: Iterable[Plugin]) -> PredictsLatency | None:
    """The plugin among ``plugins`` that predicts latency, if there is one."""
    return next((p for p in plugins if isinstance(p, PredictsLatency)), None)
