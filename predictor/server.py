"""``llm-epp-predictor``: a prediction server (FastAPI; port 8001 by default). Several run side
by side (8001, 8002, ...) and the EPP spreads its calls over them.

==============================  ================================================================
``POST /predict/bulk/strict``   ``{"requests": [FeatureRow, ...]}`` (1 to ``max_rows`` rows) →
                                ``{"predictions": [{"ttft_ms", "tpot_ms", "model_type",
                                "quantile", "last_model_load"}], "total_requests",
                                "processing_time_ms", "model_version",
                                "constant_models"}`` (the targets whose model is a constant,
                                no trees); any invalid row → 422
                                naming it, no predictions. Or the binary form
                                (:mod:`wire.latency_binary`, what the EPP sends): a float64
                                row matrix in, float32 (TTFT, TPOT) pairs out, errors in JSON
``POST /predict/bulk``          the same, but an invalid row gets ``null`` and an entry in
                                ``"errors": [{"index", "error"}]``; the others are predicted
``GET /status``                 model versions, load time, source, call counts
``GET /readyz``                 503 until a model is loaded, then 200
``GET /healthz``, ``/metrics``  liveness, Prometheus
==============================  ================================================================

Both prediction routes answer 503 before the first model is loaded, 422 for 0 rows, more than
``max_rows`` or a body that is not ``{"requests": [...]}``, 400 for a body that is not JSON (or
not whole rows, in binary), 413 past ``max_body_bytes``, and ``/predict/bulk`` 415 for a binary
body. They are plain ASGI apps (:mod:`predictor.bulk`), answered ahead of FastAPI
(:class:`PredictorApp`).

Scaling: one process per instance and one instance per core, each on its own port. A binary
call of 100 rows costs about 0.6 ms of the instance's CPU (almost half of it XGBoost, with the
trainer's default 120 trees of depth 5 per model; 0.83 ms in JSON), so an instance serves about
1,650 such calls a second on a core of its own (``llm-epp-bench predictor --throughput-only``).
Add instances, which the EPP spreads its calls over, rather than uvicorn workers: workers would
each poll and load the models, and split ``/metrics`` and ``/status`` across processes that a
scrape cannot tell apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from predictor.bulk import BulkPredictions
from predictor.metrics import PredictorMetrics
from predictor.models import LatencyModel
from predictor.reload import DirectorySource, ModelReloader, ModelSource, TrainerSource
from predictor.settings import PredictorSettings
from wire.webapp import add_common_routes, json_response, parse_settings, serve


class PredictorApp(FastAPI):
    """A FastAPI app that answers ``POST`` to the prediction routes itself, ahead of FastAPI's
    middleware and router (about 40 µs a call). They are also mounted on the router, which
    answers other methods on those paths with 405."""

    def __init__(self, prediction_routes: Mapping[str, BulkPredictions], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prediction_routes = dict(prediction_routes)
        for path, endpoint in self.prediction_routes.items():
            self.router.routes.append(Route(path, endpoint, methods=["POST"]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.prediction_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


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

    routes = {
        path: BulkPredictions(
            reloader,
            metrics,
            strict=strict,
            max_rows=settings.max_rows,
            max_body_bytes=settings.max_body_bytes,
        )
        for path, strict in (("/predict/bulk/strict", True), ("/predict/bulk", False))
    }
    app = PredictorApp(routes, title="llm-epp predictor", lifespan=lifespan)
    app.state.reloader = reloader
    add_common_routes(app, metrics.registry, lambda: None if reloader.current else "no model loaded yet")

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


def _describe(model: LatencyModel) -> dict[str, Any]:
    return model.info.model_dump(mode="json", exclude={"feature_columns"})


def main(argv: Sequence[str] | None = None) -> None:
    settings, log_level = parse_settings(
        PredictorSettings, argv, "llm-epp-predictor", "Prediction server of the latency models"
    )
    serve(create_app(settings), settings.host, settings.port, log_level, health_port=settings.health_port)


if __name__ == "__main__":
    main()
