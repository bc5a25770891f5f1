"""The prediction routes, ``POST /predict/bulk/strict`` and ``POST /predict/bulk``, as plain ASGI
apps mounted on the server's router.

They are the hot path (1,000 calls a second of 100 rows each), so they skip FastAPI's endpoint
machinery (parameter resolution, response wrapping) and build the response text themselves:
one JSON parse, the vectorised row decoder, one XGBoost call per model and one string
formatting for all the predictions. The strict route also takes the binary form of
:mod:`wire.latency_binary` (the EPP's), which skips the JSON both ways.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from predictor.metrics import PredictorMetrics
from predictor.models import ModelSet
from predictor.reload import ModelReloader
from trainer.features import RowError, decode_feature_matrix, decode_feature_rows, decode_feature_rows_partial
from wire.latency_binary import (
    CONSTANT_MODELS_HEADER,
    FEATURE_ROWS_TYPE,
    MODEL_VERSION_HEADER,
    PREDICTIONS_TYPE,
    MalformedBody,
    decode_rows,
    encode_predictions,
)
from wire.webapp import JSON, BadBody, internal_error, json_error, read_body, read_json_body


class BulkPredictions:
    """One prediction route. ``strict``: any invalid row refuses the whole call with 422 naming
    it; otherwise an invalid row gets ``null`` and an entry in ``"errors"``."""

    def __init__(
        self,
        reloader: ModelReloader,
        metrics: PredictorMetrics,
        *,
        strict: bool,
        max_rows: int,
        max_body_bytes: int,
    ) -> None:
        self.reloader = reloader
        self.strict = strict
        self.max_rows = max_rows
        self.max_body_bytes = max_body_bytes
        endpoint = "strict" if strict else "bulk"
        self._ok, self._invalid, self._unavailable = (
            metrics.calls.labels(endpoint, outcome) for outcome in ("ok", "invalid", "unavailable")
        )
        self._rows = metrics.rows
        self._duration = metrics.duration

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self._respond(request, time.perf_counter())
        except Exception as exc:  # served ahead of FastAPI's error middleware: answer as it would
            response = internal_error(request, exc)
        await response(scope, receive, send)

    async def _respond(self, request: Request, started: float) -> Response:
        models = self.reloader.current
        if models is None:
            self._unavailable.inc()
            return json_error(503, "no model loaded yet")
        try:
            if _media_type(request) == FEATURE_ROWS_TYPE:
                return await self._binary_call(models, request, started)
            return self._json_call(models, await read_json_body(request, self.max_body_bytes), started)
        except BadBody as exc:
            self._invalid.inc()
            return json_error(exc.status, exc.message)
        except RowError as exc:
            self._invalid.inc()
            return json_error(
                422, str(exc), errors=[{"index": exc.index, "field": exc.field, "error": exc.message}]
            )

    def _json_call(self, models: ModelSet, body: Any, started: float) -> Response:
        rows = body.get("requests") if isinstance(body, dict) and len(body) == 1 else None
        if not isinstance(rows, list) or not 1 <= len(rows) <= self.max_rows:
            raise BadBody(
                422, f'the body must be {{"requests": [feature row, ...]}} with 1 to {self.max_rows} rows'
            )
        errors: dict[int, RowError] = {}
        if self.strict:
            features = decode_feature_rows(rows)
        else:
            features, errors = decode_feature_rows_partial(rows)
        ttft, tpot = models.predict(features)
        text = predictions_text(models, ttft, tpot, errors)
        elapsed = self._served(len(rows) - len(errors), started)
        extra = ""
        if not self.strict:
            listed = [
                {"index": e.index, "error": f"{e.field or 'row'}: {e.message}"} for e in errors.values()
            ]
            extra = f',"errors":{json.dumps(listed)}'
        return Response(
            f'{{"predictions":[{text}],"total_requests":{len(rows)},'
            f'"processing_time_ms":{elapsed * 1e3:.3f},"model_version":{models.version},'
            f'"constant_models":{json.dumps(models.constant_targets)}{extra}}}',
            media_type=JSON,
        )

    async def _binary_call(self, models: ModelSet, request: Request, started: float) -> Response:
        """A call in the binary form of :mod:`wire.latency_binary` (all or nothing, as strict)."""
        if not self.strict:
            raise BadBody(415, f"{FEATURE_ROWS_TYPE} bodies are served by /predict/bulk/strict only")
        try:
            matrix = decode_rows(await read_body(request, self.max_body_bytes))
        except MalformedBody as exc:
            raise BadBody(400, str(exc)) from None
        if not 1 <= len(matrix) <= self.max_rows:
            raise BadBody(422, f"the body must carry 1 to {self.max_rows} rows, not {len(matrix)}")
        ttft, tpot = models.predict(decode_feature_matrix(matrix))
        self._served(len(matrix), started)
        headers = {MODEL_VERSION_HEADER: str(models.version)}
        if models.constant_targets:
            headers[CONSTANT_MODELS_HEADER] = ",".join(models.constant_targets)
        return Response(encode_predictions(ttft, tpot), media_type=PREDICTIONS_TYPE, headers=headers)

    def _served(self, rows: int, started: float) -> float:
        """Count a successful call of ``rows`` predicted rows; its time so far, in seconds."""
        self._ok.inc()
        self._rows.inc(rows)
        elapsed = time.perf_counter() - started
        self._duration.observe(elapsed)
        return elapsed


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


def predictions_text(models: ModelSet, ttft: np.ndarray, tpot: np.ndarray, invalid: Collection[int]) -> str:
    """The items of ``"predictions"``, comma-separated, ``null`` for the rows in ``invalid``: one
    ``%`` formatting for all rows rather than a model object, or a format call, per row."""
    quantile = "null" if models.quantile is None else repr(models.quantile)
    row = (
        '{"ttft_ms":%.3f,"tpot_ms":%.3f,"model_type":"xgboost",'
        f'"quantile":{quantile},"last_model_load":"{models.loaded_at.isoformat()}"}}'
    )
    if invalid:
        valid = [i for i in range(len(ttft)) if i not in invalid]
        template = ",".join("null" if i in invalid else row for i in range(len(ttft)))
        ttft, tpot = ttft[valid], tpot[valid]
    else:
        template = ",".join([row] * len(ttft))
    return template % tuple(np.column_stack((ttft, tpot)).ravel().tolist())
