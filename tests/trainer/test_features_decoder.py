"""The vectorised decoder against pydantic: same matrices for valid rows, same verdicts for bad ones."""

from __future__ import annotations

import math
import typing
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

from tests.trainer.synthetic import feature_rows, training_samples
from trainer.features import (
    FEATURE_COLUMNS,
    FEATURE_ROW_DECODER,
    TRAINING_SAMPLE_DECODER,
    ColumnDecoder,
    RowError,
    decode_feature_rows,
    decode_feature_rows_partial,
    feature_matrix,
)
from wire.latency import FeatureRow, FeatureRowDict, TrainingSample, TrainingSampleDict

# Values of every kind a JSON body can carry, valid or not for some field.
ODD_VALUES = st.sampled_from(
    [
        -1,
        -0.5,
        0,
        1,
        0.5,
        1.0,
        3.0,
        1.5,
        2,
        10_000_000,
        10_000_001,
        10**30,
        float("nan"),
        float("inf"),
        -float("inf"),
        True,
        False,
        None,
        "",
        "3",
        "0.5",
        "prefill",
        "decode",
        "other",
        [],
        {},
    ]
)

VALID_ROW = st.fixed_dictionaries(
    {
        "kv_cache_percentage": st.floats(0.0, 1.0) | st.sampled_from([0, 1]),
        "input_token_length": st.integers(0, 10_000_000),
        "num_request_waiting": st.integers(0, 1_000_000),
        "num_request_running": st.integers(0, 1_000_000),
    },
    optional={
        "num_tokens_generated": st.integers(0, 10_000_000),
        "prefix_cache_score": st.floats(0.0, 1.0),
        "pod_type": st.sampled_from(["", "prefill", "decode"]),
        "prefill_tokens_in_flight": st.integers(0, 10_000_000),
        "decode_tokens_in_flight": st.integers(0, 10_000_000),
        "endpoint_class": st.integers(0, (1 << 24) - 1),
    },
)


@st.composite
def maybe_bad_row(draw: st.DrawFn) -> Any:
    """A valid row, possibly damaged: a field changed to an odd value, dropped, or added."""
    row = dict(draw(VALID_ROW))
    damage = draw(st.sampled_from(["none", "none", "value", "drop", "extra", "not_a_dict"]))
    if damage == "value":
        row[draw(st.sampled_from(sorted(FeatureRow.model_fields)))] = draw(ODD_VALUES)
    elif damage == "drop" and row:
        del row[draw(st.sampled_from(sorted(row)))]
    elif damage == "extra":
        row["unknown_field"] = 1
    elif damage == "not_a_dict":
        return draw(st.sampled_from([None, 1, "row", [], [row]]))
    return row


def pydantic_verdicts(items: list[Any]) -> tuple[list[FeatureRow], dict[int, str]]:
    models, errors = [], {}
    for index, item in enumerate(items):
        try:
            models.append(FeatureRow.model_validate(item))
        except ValidationError as exc:
            errors[index] = ".".join(map(str, exc.errors()[0]["loc"]))
    return models, errors


@settings(max_examples=300, deadline=None)
@given(st.lists(VALID_ROW, min_size=1, max_size=40))
def test_valid_rows_give_the_pydantic_matrix(rows: list[dict[str, Any]]) -> None:
    expected = feature_matrix([FeatureRow.model_validate(r) for r in rows])
    assert np.array_equal(decode_feature_rows(rows), expected)
    matrix, errors = decode_feature_rows_partial(rows)
    assert errors == {}
    assert np.array_equal(matrix, expected)


@settings(max_examples=500, deadline=None)
@given(st.lists(maybe_bad_row(), min_size=1, max_size=12))
def test_bad_rows_are_refused_as_pydantic_refuses_them(items: list[Any]) -> None:
    models, expected_errors = pydantic_verdicts(items)
    if expected_errors:
        first = min(expected_errors)
        with pytest.raises(RowError) as caught:
            decode_feature_rows(items)
        assert (caught.value.index, caught.value.field) == (first, expected_errors[first])
    else:
        assert np.array_equal(decode_feature_rows(items), feature_matrix(models))
    matrix, errors = decode_feature_rows_partial(items)
    assert {i: e.field for i, e in errors.items()} == expected_errors
    valid = [i for i in range(len(items)) if i not in expected_errors]
    assert np.array_equal(matrix[valid], feature_matrix(models))


def test_the_fast_path_matches_pydantic_on_typical_rows() -> None:
    rows = feature_rows(500)
    assert np.array_equal(decode_feature_rows(rows), feature_matrix([FeatureRow(**r) for r in rows]))


def test_training_samples_decode_like_pydantic() -> None:
    samples = training_samples(200)
    columns = TRAINING_SAMPLE_DECODER.decode(samples)
    models = [TrainingSample.model_validate(s) for s in samples]
    for name in ("actual_ttft_ms", "actual_tpot_ms", "timestamp", "input_token_length"):
        assert columns[name].tolist() == [float(getattr(m, name)) for m in models]


@pytest.mark.parametrize(
    ("field", "value", "error_type"),
    [
        ("kv_cache_percentage", float("nan"), "finite_number"),
        ("kv_cache_percentage", float("inf"), "finite_number"),
        ("kv_cache_percentage", 1.5, "less_than_equal"),
        ("num_request_waiting", -1, "greater_than_equal"),
        ("input_token_length", 3.0, "int_type"),
        ("input_token_length", "3", "int_type"),
        ("input_token_length", True, "int_type"),
        ("prefix_cache_score", "0.5", "float_type"),
        ("pod_type", "gpu", "literal_error"),
        ("surprise", 1, "extra_forbidden"),
    ],
)
def test_errors_name_row_field_and_type(field: str, value: Any, error_type: str) -> None:
    rows = feature_rows(5)
    rows[3] = {**rows[3], field: value}
    with pytest.raises(RowError) as caught:
        decode_feature_rows(rows)
    assert (caught.value.index, caught.value.field, caught.value.error_type) == (3, field, error_type)


def test_a_missing_required_field_is_named() -> None:
    rows = feature_rows(3)
    del rows[1]["num_request_running"]
    with pytest.raises(RowError) as caught:
        decode_feature_rows(rows)
    assert (caught.value.index, caught.value.field, caught.value.error_type) == (
        1,
        "num_request_running",
        "missing",
    )


def test_defaults_fill_omitted_optional_fields() -> None:
    row = {
        "kv_cache_percentage": 0.5,
        "input_token_length": 100,
        "num_request_waiting": 2,
        "num_request_running": 3,
    }
    matrix = decode_feature_rows([row])
    assert matrix.shape == (1, len(FEATURE_COLUMNS))
    assert np.array_equal(matrix, feature_matrix([FeatureRow(**row)]))


def test_derived_columns() -> None:
    row = {
        "kv_cache_percentage": 0.25,
        "input_token_length": 1000,
        "num_request_waiting": 3,
        "num_request_running": 1,
        "prefix_cache_score": 0.75,
        "pod_type": "decode",
    }
    values = dict(zip(FEATURE_COLUMNS, decode_feature_rows([row])[0].tolist(), strict=True))
    assert values["effective_input_tokens"] == 250.0
    assert (values["is_queued"], values["is_prefill_pod"], values["is_decode_pod"]) == (1.0, 0.0, 1.0)


def test_an_empty_batch_is_an_empty_matrix() -> None:
    assert decode_feature_rows([]).shape == (0, len(FEATURE_COLUMNS))


def test_models_the_decoder_cannot_check_are_refused() -> None:
    class Lax(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: int
        b: int

    class Listy(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        a: int
        b: list[int]

    for model in (Lax, Listy):
        with pytest.raises(TypeError):
            ColumnDecoder(model)


def test_module_decoders_cover_every_field() -> None:
    assert set(FEATURE_ROW_DECODER.decode(feature_rows(2))) == set(FeatureRow.model_fields)
    assert math.isclose(
        FEATURE_ROW_DECODER.decode(feature_rows(1))["kv_cache_percentage"][0],
        feature_rows(1)[0]["kv_cache_percentage"],
    )


@pytest.mark.parametrize(
    ("model", "sent"), [(FeatureRow, FeatureRowDict), (TrainingSample, TrainingSampleDict)]
)
def test_what_the_epp_sends_is_the_schema_the_servers_validate(model, sent) -> None:
    hints = typing.get_type_hints(sent)
    assert hints == {name: field.annotation for name, field in model.model_fields.items()}
