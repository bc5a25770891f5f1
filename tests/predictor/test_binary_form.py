"""The binary form of a bulk call (``wire.latency_binary``): its codec, and its rows validated as
the same rows in JSON are."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.trainer.synthetic import ROW_FIELDS, feature_rows
from tests.trainer.test_features_decoder import VALID_ROW
from trainer.features import RowError, decode_feature_matrix, decode_feature_rows
from wire.latency import POD_TYPES, FeatureRow
from wire.latency_binary import (
    FEATURE_ROW_FIELDS,
    ROW_BYTES,
    MalformedBody,
    decode_predictions,
    decode_rows,
    encode_predictions,
    encode_rows,
)

DEFAULTS = {name: info.default for name, info in FeatureRow.model_fields.items() if not info.is_required()}
ODD_NUMBERS = st.sampled_from(
    [-1.0, -0.5, 0.5, 1.5, 2.0, 3.0, 1e7, 1e7 + 1, 1e30, math.nan, math.inf, -math.inf, -0.0]
)


def full(row: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS, **row}


def as_json_row(values: list[float]) -> dict[str, Any]:
    """The JSON row a matrix row stands for: integral numbers of integer fields as ints, a pod
    type's index as its name; any other number as it is."""
    row: dict[str, Any] = {}
    for name, value in zip(FEATURE_ROW_FIELDS, values, strict=True):
        annotation = FeatureRow.model_fields[name].annotation
        integral = math.isfinite(value) and value.is_integer()
        if name == "pod_type" and integral and 0 <= value < len(POD_TYPES):
            row[name] = POD_TYPES[int(value)]
        elif annotation is int and integral:
            row[name] = int(value)
        else:
            row[name] = value
    return row


@settings(max_examples=300, deadline=None)
@given(st.lists(VALID_ROW, min_size=1, max_size=40))
def test_valid_rows_give_the_json_rows_matrix(rows: list[dict[str, Any]]) -> None:
    sent = [full(r) for r in rows]
    matrix = decode_rows(encode_rows(sent))
    assert matrix.shape == (len(rows), len(FEATURE_ROW_FIELDS))
    assert np.array_equal(decode_feature_matrix(matrix), decode_feature_rows(sent))


@settings(max_examples=500, deadline=None)
@given(
    st.lists(VALID_ROW, min_size=1, max_size=8),
    st.data(),
)
def test_bad_values_are_refused_as_pydantic_refuses_the_json_row(
    rows: list[dict[str, Any]], data: st.DataObject
) -> None:
    matrix = decode_rows(encode_rows([full(r) for r in rows])).copy()
    damaged = data.draw(st.integers(0, len(rows) - 1))
    column = data.draw(st.integers(0, len(FEATURE_ROW_FIELDS) - 1))
    matrix[damaged, column] = data.draw(ODD_NUMBERS)
    json_rows = [as_json_row(values) for values in matrix.tolist()]
    try:
        FeatureRow.model_validate(json_rows[damaged])
    except ValidationError as exc:
        first = exc.errors()[0]
        with pytest.raises(RowError) as caught:
            decode_feature_matrix(matrix)
        assert (caught.value.index, caught.value.field) == (damaged, first["loc"][0])
        assert caught.value.message == first["msg"]
    else:
        assert np.array_equal(decode_feature_matrix(matrix), decode_feature_rows(json_rows))


def test_the_matrix_follows_the_field_order() -> None:
    row = full(feature_rows(1)[0]) | {"pod_type": "decode"}
    (values,) = decode_rows(encode_rows([row])).tolist()
    row["pod_type"] = POD_TYPES.index("decode")
    assert values == [row[name] for name in ROW_FIELDS]  # the schema's declaration order


def test_a_body_that_is_not_whole_rows_is_malformed() -> None:
    body = encode_rows([full(r) for r in feature_rows(2)])
    assert len(body) == 2 * ROW_BYTES
    with pytest.raises(MalformedBody, match=f"{ROW_BYTES} bytes each"):
        decode_rows(body[:-1])
    assert decode_rows(b"").shape == (0, len(FEATURE_ROW_FIELDS))


def test_an_unknown_pod_type_cannot_be_encoded() -> None:
    with pytest.raises(KeyError):
        encode_rows([full(feature_rows(1)[0]) | {"pod_type": "other"}])


def test_predictions_round_trip_as_float32() -> None:
    ttft = np.array([12.5, 1e6, 0.0], np.float32)
    tpot = np.array([3.25, 0.0, 7.0])
    assert decode_predictions(encode_predictions(ttft, tpot)) == [[12.5, 3.25], [1e6, 0.0], [0.0, 7.0]]
    with pytest.raises(MalformedBody):
        decode_predictions(b"\0" * 12)
