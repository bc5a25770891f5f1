"""``llm-epp-predictor``: a prediction server (FastAPI; port 8001 by default). Several run side
by side (8001, 8002, ...) and the EPP spreads its calls over them.

==============================  ================================================================
``POST /predict/bulk/strict``   ``{"requests": [FeatureRow, ...]}`` (1 to ``max_rows`` rows) →
                                ``{"predictions": [{"ttft_ms", "tpot_ms", "model_type",
                                "quantile", "last_model_load"}], "total_requests",
                                "processing_time_ms", "model_version"}``; any invalid row → 422
                                naming it, no predictions
``POST /predict/bulk``          the same, but an invalid row gets ``null`` and an entry in
                                ``"errors": [{"index", "error"}]``; the others are predicted
``GET /status``                 model versions, load time, source, call counts
``GET /readyz``                 503 until a model is loaded, then 200
``GET /healthz``, ``/metrics``  liveness, Prometheus
==============================  ================================================================

Both prediction routes answer 503 before the first model is loaded, 422 for 0 rows, more than
``max_rows`` or a body that is not ``{"requests": [...]}``, 400 for a body that is not JSON and
413 past ``max_body_bytes``. The hot path takes the raw request and builds the response text
itself: one JSON parse, the vectorised row decoder, one XGBoost call per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from predictor.metrics import PredictorMetrics
from predictor.models import ModelSet, ServedModel
from predictor.reload import DirectorySource, ModelReloader, ModelSource, TrainerSource
from predictor.settings import PredictorSettings
from trainer.features import RowError, decode_feature_rows, decode_feature_rows_partial
from trainer.webapp import (
    JSON,
    BadBody,
    add_common_routes,
    json_error,
    json_response,
    parse_settings,
    read_json_body,
    serve,
)


class _BadRequest(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def source_for(settings: PredictorSettings) -> ModelSource:
    if settings.trainer_url is not None:
        return TrainerSource(settings.trainer_url, settings.fetch_timeout_s)
    assert settings.model_dir is not None
    return DirectorySource(settings.model_dir)


def create_app(settings: PredictorSettings, reloader: ModelReloader | None = None) -> FastAPI:
    """The prediction server's app; it polls its model source while it runs (lifespan)."""
    metrics = reloader.metrics if reloader else PredictorMetrics()
    reloader = reloader or ModelReloader(
        source_for(settings),
        metrics,
        poll_interval_s=settings.poll_interval_s,
        threads=settings.predict_threads,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(reloader.run_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await reloader.source.close()

    app = FastAPI(title="llm-epp predictor", lifespan=lifespan)
    app.state.reloader = reloader
    add_common_routes(app, metrics.registry, lambda: None if reloader.current else "no model loaded yet")

    async def rows_of(request: Request, endpoint: str) -> tuple[ModelSet, list[Any]]:
        models = reloader.current
        if models is None:
            metrics.calls.labels(endpoint, "unavailable").inc()
            raise _BadRequest(json_error(503, "no model loaded yet"))
        try:
            body = await read_json_body(request, settings.max_body_bytes)
        except BadBody as exc:
            metrics.calls.labels(endpoint, "invalid").inc()
            raise _BadRequest(json_error(exc.status, exc.message)) from None
        rows = body.get("requests") if isinstance(body, dict) and len(body) == 1 else None
        if not isinstance(rows, list) or not 1 <= len(rows) <= settings.max_rows:
            metrics.calls.labels(endpoint, "invalid").inc()
            raise _BadRequest(
                json_error(
                    422,
                    f'the body must be {{"requests": [feature row, ...]}} with 1 to {settings.max_rows} rows',
                )
            )
        return models, rows

    @app.post("/predict/bulk/strict")
    async def predict_bulk_strict(request: Request) -> Response:
        started = time.perf_counter()
        try:
            models, rows = await rows_of(request, "strict")
        except _BadRequest as exc:
            return exc.response
        try:
            features = decode_feature_rows(rows)
        except RowError as exc:
            metrics.calls.labels("strict", "invalid").inc()
            return json_error(
                422, str(exc), errors=[{"index": exc.index, "field": exc.field, "error": exc.message}]
            )
        ttft, tpot = models.predict(features)
        return _predictions_response(models, ttft, tpot, None, started, metrics, "strict")

    @app.post("/predict/bulk")
    async def predict_bulk(request: Request) -> Response:
        started = time.perf_counter()
        try:
            models, rows = await rows_of(request, "bulk")
        except _BadRequest as exc:
            return exc.response
        features, errors = decode_feature_rows_partial(rows)
        ttft, tpot = models.predict(features)
        return _predictions_response(models, ttft, tpot, errors, started, metrics, "bulk")

    @app.get("/status")
    async def status() -> Response:
        models = reloader.current
        calls = metrics.registry.get_sample_value
        return json_response(
            {
                "ready": models is not None,
                "source": reloader.source.description,
                "poll_interval_s": reloader.poll_interval_s,
                "model_version": models.version if models else None,
                "last_model_load": models.loaded_at.isoformat() if models else None,
                "models": {
                    "ttft": _describe(models.ttft) if models else None,
                    "tpot": _describe(models.tpot) if models and models.tpot else None,
                },
                "counts": {
                    "model_loads": reloader.loads,
                    "model_load_failures": reloader.failures,
                    "rows_predicted": int(calls("predictor_rows_total") or 0),
                    "calls_ok": sum(
                        int(calls("predictor_calls_total", {"endpoint": e, "outcome": "ok"}) or 0)
                        for e in ("strict", "bulk")
                    ),
                },
            }
        )

    return app


def _describe(model: ServedModel) -> dict[str, Any]:
    return model.info.model_dump(mode="json", exclude={"feature_columns"})


def _predictions_response(
    models: ModelSet,
    ttft: np.ndarray,
    tpot: np.ndarray,
    errors: dict[int, RowError] | None,
    started: float,
    metrics: PredictorMetrics,
    endpoint: str,
) -> Response:
    """The predictions as JSON text, built without a model object per row."""
    quantile = "null" if models.quantile is None else repr(models.quantile)
    tail = (
        f',"model_type":"xgboost","quantile":{quantile},"last_model_load":"{models.loaded_at.isoformat()}"}}'
    )
    head = '{{"ttft_ms":{:.3f},"tpot_ms":{:.3f}'.format
    items = [head(a, b) + tail for a, b in zip(ttft.tolist(), tpot.tolist(), strict=True)]
    extra = ""
    if errors is not None:
        for index in errors:
            items[index] = "null"
        listed = [{"index": e.index, "error": f"{e.field or 'row'}: {e.message}"} for e in errors.values()]
        extra = f',"errors":{json.dumps(listed)}'
    n = len(items)
    elapsed = time.perf_counter() - started
    metrics.calls.labels(endpoint, "ok").inc()
    metrics.rows.inc(n - len(errors or ()))
    metrics.duration.observe(elapsed)
    text = (
        f'{{"predictions":[{",".join(items)}],"total_requests":{n},'
        f'"processing_time_ms":{elapsed * 1e3:.3f},"model_version":{models.version}{extra}}}'
    )
    return Response(text, media_type=JSON)


def main(argv: Sequence[str] | None = None) -> None:
    settings, log_level = parse_settings(
        PredictorSettings, argv, "llm-epp-predictor", "Prediction server of the latency models"
    )
    serve(create_app(settings), settings.host, settings.port, log_level)


if __name__ == "__main__":
    main()
