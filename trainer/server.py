"""``llm-epp-trainer``: the training server (FastAPI; port 8000 by default).

=====================================  ==========================================================
``POST /add_training_data_bulk``       ``{"entries": [TrainingSample, ...]}`` → 202
                                       ``{"accepted": n}``; any invalid entry → 422 naming each
                                       bad entry's index and field, nothing accepted; body not
                                       JSON → 400; body over ``max_body_bytes`` → 413
``POST /retrain``                      → 202: retrain now (the EPP saw its predictions drift)
                                       instead of at the next interval; token-guarded
``GET /data/status``                   window sizes, per bucket of each endpoint class
``GET /model/download/info``           the current manifest (404 before the first version)
``GET /model/{ttft|tpot}/info``        that model's manifest entry (plus llm-d's
                                       ``last_modified``)
``GET /model/{ttft|tpot}/download``    its bytes (``?version=N``: the model trained in version
                                       N, while kept); headers ``X-Model-Version`` and
                                       ``X-Model-SHA256`` (of the bytes sent)
``GET /models/list``                   every model file on disk
``GET /healthz``, ``/readyz``          liveness, readiness (accepting data)
``GET /metrics``                       Prometheus
=====================================  ==========================================================

It binds 127.0.0.1 by default: only its own pod reaches it. ``--health-port`` adds a listener on
every interface that serves ``/healthz``, ``/readyz`` and ``/metrics`` and nothing else, for
kubelet probes and Prometheus.
Another ``--host`` needs ``--auth-token-file``; the mutating routes
(``POST /add_training_data_bulk``, ``POST /retrain``) then answer 401 without
``Authorization: Bearer <token>``, even on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import Response

from trainer.artifacts import MODEL_NAMES, ArtifactError, ModelName, sha256_hex
from trainer.service import SamplesRejected, TrainerService
from trainer.settings import TrainerSettings
from wire.auth import BearerToken, TokenFileError, read_token
from wire.webapp import (
    BadBody,
    add_common_routes,
    json_error,
    json_response,
    parse_settings,
    read_json_body,
    serve,
    unauthorized,
)

MAX_ERRORS_LISTED = 100


def create_app(settings: TrainerSettings, service: TrainerService | None = None) -> FastAPI:
    """The training server's app; it retrains in the background while it runs (lifespan)."""
    service = service or TrainerService(settings)
    token = BearerToken(read_token(settings.auth_token_file)) if settings.auth_token_file else None
    ready = False

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal ready
        task = asyncio.create_task(service.run_forever())
        ready = True
        try:
            yield
        finally:
            ready = False
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="llm-epp trainer", lifespan=lifespan)
    app.state.service = service
    metrics = service.metrics
    add_common_routes(app, metrics.registry, lambda: None if ready else "starting")

    @app.post("/add_training_data_bulk")
    async def add_training_data_bulk(request: Request) -> Response:
        if token is not None and not token.allows(request.headers.get("authorization")):
            metrics.rejected_requests.labels("unauthorized").inc()
            return unauthorized()
        try:
            body = await read_json_body(request, settings.max_body_bytes)
        except BadBody as exc:
            metrics.rejected_requests.labels("too_large" if exc.status == 413 else "bad_json").inc()
            return json_error(exc.status, exc.message)
        if not isinstance(body, dict) or set(body) != {"entries"} or not isinstance(body["entries"], list):
            metrics.rejected_requests.labels("bad_shape").inc()
            return json_error(422, 'the body must be {"entries": [training sample, ...]}')
        try:
            accepted = service.add_samples(body["entries"])
        except SamplesRejected as exc:
            metrics.rejected_requests.labels("invalid_samples").inc()
            listed = [{"index": e.index, "field": e.field, "error": e.message} for e in exc.errors]
            return json_error(422, str(exc), errors=listed[:MAX_ERRORS_LISTED], error_count=len(listed))
        return json_response({"accepted": accepted}, 202)

    @app.post("/retrain")
    async def retrain(request: Request) -> Response:
        if token is not None and not token.allows(request.headers.get("authorization")):
            metrics.rejected_requests.labels("unauthorized").inc()
            return unauthorized()
        service.request_retrain()
        return json_response({"retrain": "requested"}, 202)

    @app.get("/data/status")
    async def data_status() -> Response:
        return json_response(service.data_status())

    @app.get("/model/download/info")
    async def download_info() -> Response:
        manifest = service.store.current
        if manifest is None:
            return json_error(404, "no model has been trained yet")
        return Response(manifest.model_dump_json(), media_type="application/json")

    @app.get("/model/{name}/info")
    async def model_info(name: str) -> Response:
        if name not in MODEL_NAMES:
            return json_error(404, f"unknown model {name!r}; models: {', '.join(MODEL_NAMES)}")
        manifest = service.store.current
        if manifest is None or name not in manifest.models:
            return json_error(404, f"there is no {name} model yet")
        info = manifest.models[cast(ModelName, name)]
        return json_response(
            {
                **info.model_dump(mode="json"),
                "manifest_version": manifest.version,
                "last_modified": info.created.isoformat(),
            }
        )

    @app.get("/model/{name}/download")
    async def model_download(name: str, version: int | None = None) -> Response:
        if name not in MODEL_NAMES:
            return json_error(404, f"unknown model {name!r}; models: {', '.join(MODEL_NAMES)}")
        try:
            found, data = await asyncio.to_thread(service.store.read_model, cast(ModelName, name), version)
        except ArtifactError as exc:
            return json_error(404, str(exc))
        headers = {"X-Model-Version": str(found), "X-Model-SHA256": sha256_hex(data)}
        return Response(data, media_type="application/octet-stream", headers=headers)

    @app.get("/models/list")
    async def models_list() -> Response:
        manifest = service.store.current
        current = {info.file for info in manifest.models.values()} if manifest else set()
        files: list[dict[str, Any]] = []
        for name, version, path in service.store.model_files():
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # pruned meanwhile
                continue
            files.append(
                {
                    "name": name,
                    "version": version,
                    "file": path.name,
                    "size_bytes": size,
                    "current": path.name in current,
                }
            )
        return json_response({"version": manifest.version if manifest else None, "models": files})

    return app


def main(argv: Sequence[str] | None = None) -> None:
    settings, log_level = parse_settings(
        TrainerSettings, argv, "llm-epp-trainer", "Training server of the latency models"
    )
    try:
        app = create_app(settings)
    except ArtifactError as exc:
        raise SystemExit(f"llm-epp-trainer: cannot use model directory {settings.model_dir}: {exc}") from None
    except TokenFileError as exc:
        raise SystemExit(f"llm-epp-trainer: --auth-token-file: {exc}") from None
    serve(app, settings.host, settings.port, log_level, health_port=settings.health_port)


if __name__ == "__main__":
    main()
