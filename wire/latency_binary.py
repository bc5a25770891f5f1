"""The binary form of a bulk prediction call: feature rows as one float64 matrix, predictions as
one float32 matrix, instead of JSON objects.

The EPP sends 100 rows a call, 1,000 calls a second. As JSON, that is about 25 kB of objects
that the predictor parses, checks field by field and answers with 100 objects of text: about
0.15 ms of its CPU a call. As matrices, it is one copy each way.

Request (``POST /predict/bulk/strict``, ``Content-Type: application/vnd.llm-epp.feature-rows``):
rows × ``len(FEATURE_ROW_FIELDS)`` little-endian float64, row-major, one column per
:class:`~wire.latency.FeatureRow` field in declaration order; ``pod_type`` is its index in
``POD_TYPES``; integer fields must hold integral values. The rules are the JSON rows' (bounds,
finiteness, literal values), checked by the server.

Response (200, ``Content-Type: application/vnd.llm-epp.predictions``): rows × 2 little-endian
float32, (TTFT ms, TPOT ms) per row, the model version in the ``x-model-version`` header and,
where some of the version's models are constants (no trees: the same prediction for every row),
their targets in ``x-model-constant`` (comma-separated, ``ttft`` or ``tpot``; absent when none).
Errors are answered in JSON, as for JSON calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Final

import numpy as np

from wire.latency import POD_TYPES, FeatureRow, FeatureRowDict

FEATURE_ROWS_TYPE: Final = "application/vnd.llm-epp.feature-rows"
PREDICTIONS_TYPE: Final = "application/vnd.llm-epp.predictions"
MODEL_VERSION_HEADER: Final = "x-model-version"
CONSTANT_MODELS_HEADER: Final = "x-model-constant"

FEATURE_ROW_FIELDS: Final = tuple(FeatureRow.model_fields)
ROW_DTYPE: Final = np.dtype("<f8")
PREDICTION_DTYPE: Final = np.dtype("<f4")
ROW_BYTES: Final = len(FEATURE_ROW_FIELDS) * ROW_DTYPE.itemsize

_POD_COLUMN: Final = FEATURE_ROW_FIELDS.index("pod_type")
_NUMERIC_COLUMNS: Final = [i for i, name in enumerate(FEATURE_ROW_FIELDS) if i != _POD_COLUMN]
_numeric_values = itemgetter(*(FEATURE_ROW_FIELDS[i] for i in _NUMERIC_COLUMNS))
_POD_CODES: Final = {name: float(code) for code, name in enumerate(POD_TYPES)}


class MalformedBody(ValueError):
    """A binary body whose size or shape cannot be what its content type says."""


def encode_rows(rows: Sequence[FeatureRowDict]) -> bytes:
    """The request body for ``rows`` (every field present); a ``pod_type`` outside
    ``POD_TYPES`` raises KeyError."""
    matrix = np.empty((len(rows), len(FEATURE_ROW_FIELDS)), ROW_DTYPE)
    if rows:
        matrix[:, _NUMERIC_COLUMNS] = list(map(_numeric_values, rows))
        matrix[:, _POD_COLUMN] = [_POD_CODES[row["pod_type"]] for row in rows]
    return matrix.tobytes()


def decode_rows(body: bytes) -> np.ndarray:
    """The request body as a rows × fields float64 matrix (read-only, not yet validated)."""
    if len(body) % ROW_BYTES:
        raise MalformedBody(
            f"a {FEATURE_ROWS_TYPE} body must be rows of {len(FEATURE_ROW_FIELDS)} float64 values "
            f"({ROW_BYTES} bytes each); got {len(body)} bytes"
        )
    return np.frombuffer(body, ROW_DTYPE).reshape(-1, len(FEATURE_ROW_FIELDS))


def encode_predictions(ttft_ms: np.ndarray, tpot_ms: np.ndarray) -> bytes:
    """The response body: (TTFT, TPOT) per row, as float32 (the models' own precision)."""
    return np.column_stack((ttft_ms, tpot_ms)).astype(PREDICTION_DTYPE).tobytes()


def decode_predictions(body: bytes) -> list[list[float]]:
    """[TTFT ms, TPOT ms] per row of a response body."""
    if len(body) % (2 * PREDICTION_DTYPE.itemsize):
        raise MalformedBody(f"a {PREDICTIONS_TYPE} body must be pairs of float32; got {len(body)} bytes")
    return np.frombuffer(body, PREDICTION_DTYPE).reshape(-1, 2).tolist()
