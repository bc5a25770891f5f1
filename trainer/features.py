"""The latency model's input columns, from feature rows and training samples (their wire schema
is :mod:`wire.latency`). ``feature_matrix`` and ``decode_feature_rows`` turn rows into the
model's input columns; both go through ``matrix_from_columns``, the one place derived features
are computed, so training and serving can never disagree.

Validating rows one by one with pydantic costs several microseconds per row, too slow for the
predictor's hot path (100 rows per call, 1,000 calls a second). :class:`ColumnDecoder` checks a
whole batch of parsed JSON objects column by column with numpy against the rules it reads from
the pydantic model's fields (types, bounds, finiteness, defaults, literal values), and asks
pydantic only when that check fails, to name the bad row and field. Its fast check accepts a
subset of what pydantic accepts, with the same values, so the two paths cannot disagree.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any, Literal

import annotated_types
import numpy as np
from pydantic import AllowInfNan, BaseModel, ValidationError

from wire.latency import POD_TYPES, FeatureRow, TrainingSample

FEATURE_COLUMNS = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "endpoint_class",
    "effective_input_tokens",
    "is_queued",
    "is_prefill_pod",
    "is_decode_pod",
)

_DERIVED = FEATURE_COLUMNS.index("effective_input_tokens")
"""Columns before this one are row fields as sent; from it on, computed from them."""

Columns = Mapping[str, np.ndarray]
"""Validated rows by field: numbers as float64, literal fields as int8 indexes into their values."""


def matrix_from_columns(columns: Columns) -> np.ndarray:
    """Model input, columns in ``FEATURE_COLUMNS`` order (float32); derived features made here."""
    length = columns["input_token_length"]
    prefix = columns["prefix_cache_score"]
    pod = columns["pod_type"]
    n = len(length)
    out = np.empty((n, len(FEATURE_COLUMNS)), dtype=np.float32)
    for i, name in enumerate(FEATURE_COLUMNS[:_DERIVED]):
        out[:, i] = columns[name]
    out[:, _DERIVED] = (1.0 - prefix) * length
    out[:, _DERIVED + 1] = columns["num_request_waiting"] > 0
    out[:, _DERIVED + 2] = pod == POD_TYPES.index("prefill")
    out[:, _DERIVED + 3] = pod == POD_TYPES.index("decode")
    return out


def feature_matrix(rows: Sequence[FeatureRow]) -> np.ndarray:
    """Model input, one row per feature row, columns in ``FEATURE_COLUMNS`` order (float32)."""
    return matrix_from_columns(_columns_of_models(FeatureRow, rows))


class RowError(ValueError):
    """Row ``index`` of a batch is invalid.

    ``field`` names the offending field ("" when the row itself is not an object), ``message``
    says what is wrong and ``error_type`` is pydantic's error type (``missing``,
    ``extra_forbidden``, ``int_type``, ``finite_number``, ``less_than_equal``, ...).
    """

    def __init__(self, index: int, field: str, message: str, error_type: str) -> None:
        super().__init__(f"row {index}: {field or 'row'}: {message}")
        self.index = index
        self.field = field
        self.message = message
        self.error_type = error_type


@dataclass(frozen=True, slots=True)
class _FieldRule:
    name: str
    kind: Literal["int", "float", "literal"]
    required: bool
    default: Any
    low: float
    high: float
    finite: bool
    codes: dict[str, int]
    """A literal field's values and their indexes."""


def _rules(model: type[BaseModel]) -> tuple[_FieldRule, ...]:
    """The constraints of each field of ``model``, read from its pydantic field definitions."""
    rules = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        values: tuple[Any, ...] = ()
        kind: Literal["int", "float", "literal"]
        if typing.get_origin(annotation) is Literal:
            kind, values = "literal", typing.get_args(annotation)
            if not all(isinstance(v, str) for v in values):
                raise TypeError(f"{model.__name__}.{name}: only string literals are supported")
        elif annotation is int:
            kind = "int"
        elif annotation is float:
            kind = "float"
        else:
            raise TypeError(f"{model.__name__}.{name}: unsupported type {annotation!r}")
        low, high, finite = -math.inf, math.inf, kind == "int"
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                low = float(meta.ge)
            elif isinstance(meta, annotated_types.Le):
                high = float(meta.le)
            elif isinstance(meta, AllowInfNan):
                finite = not meta.allow_inf_nan
            else:
                raise TypeError(f"{model.__name__}.{name}: unsupported constraint {meta!r}")
        required = info.is_required()
        default = None if required else info.default
        codes = {value: code for code, value in enumerate(values)}
        rules.append(_FieldRule(name, kind, required, default, low, high, finite, codes))
    return tuple(rules)


class _FastCheckFailed(Exception):
    """An item needs pydantic to say what is wrong with it."""


class ColumnDecoder:
    """Validates batches of parsed JSON objects against a flat pydantic model, into columns.

    The model's fields must be ``int``, ``float`` or a ``Literal`` of strings, constrained only
    by ``ge``, ``le`` and ``allow_inf_nan``; the model must be strict, forbid extra fields and
    have at least two fields.
    Columns come back as :data:`Columns`.
    """

    def __init__(self, model: type[BaseModel]) -> None:
        config = model.model_config
        if config.get("extra") != "forbid" or not config.get("strict") or len(model.model_fields) < 2:
            raise TypeError(f"{model.__name__} must be strict, forbid extra fields and have 2+ fields")
        self.model = model
        rules = _rules(model)
        self._rules = rules
        self._names = tuple(rule.name for rule in rules)
        self._known = frozenset(self._names)
        self._defaults = {rule.name: rule.default for rule in rules if not rule.required}
        self._get_all = itemgetter(*self._names)
        self._ints = [i for i, rule in enumerate(rules) if rule.kind == "int"]
        self._floats = [i for i, rule in enumerate(rules) if rule.kind == "float"]
        self._literals = [i for i, rule in enumerate(rules) if rule.kind == "literal"]
        self._numeric = self._ints + self._floats
        numeric_rules = [rules[i] for i in self._numeric]
        self._low = np.array([[rule.low] for rule in numeric_rules])
        self._high = np.array([[rule.high] for rule in numeric_rules])
        # NaN fails every comparison and infinities fail finite bounds, so only a finite field
        # with an infinite bound needs its own finiteness check.
        self._finite = [
            j
            for j, rule in enumerate(numeric_rules)
            if rule.finite and not (math.isfinite(rule.low) and math.isfinite(rule.high))
        ]

    def decode(self, items: Sequence[Any]) -> dict[str, np.ndarray]:
        """Columns of ``items``; raises :class:`RowError` for the first invalid one (all or nothing)."""
        columns = self._fast_columns(items)
        if columns is not None:
            return columns
        models, errors = self._validate_each(items)
        if errors:
            raise errors[min(errors)]
        return _columns_of_models(self.model, list(models.values()))

    def decode_valid(self, items: Sequence[Any]) -> tuple[dict[str, np.ndarray], dict[int, RowError]]:
        """Columns of every item (an invalid item's values are placeholders) and the errors by index."""
        columns = self._fast_columns(items)
        if columns is not None:
            return columns, {}
        models, errors = self._validate_each(items)
        placeholder = self.model.model_construct(
            **{rule.name: next(iter(rule.codes), 0) for rule in self._rules}
        )
        filled = [models.get(i, placeholder) for i in range(len(items))]
        return _columns_of_models(self.model, filled), errors

    def _fast_columns(self, items: Sequence[Any]) -> dict[str, np.ndarray] | None:
        """The columns if every item passes the vectorised check, else None."""
        if not items or set(map(type, items)) != {dict}:
            return None
        try:
            if set(map(len, items)) == {len(self._names)}:
                # As many keys as fields: any unknown key means a missing one, a KeyError here.
                rows = list(map(self._get_all, items))
            else:
                rows = list(map(self._get_all, map(self._with_defaults, items)))
        except (KeyError, _FastCheckFailed):
            return None
        columns = list(zip(*rows, strict=True))
        if not set(map(type, chain.from_iterable(columns[i] for i in self._ints))) <= {int}:
            return None
        if not set(map(type, chain.from_iterable(columns[i] for i in self._floats))) <= {int, float}:
            return None
        try:
            numeric = np.array([columns[i] for i in self._numeric], dtype=np.float64)
        except OverflowError:  # an integer beyond float64
            return None
        if not ((numeric >= self._low) & (numeric <= self._high)).all():
            return None
        if self._finite and not np.isfinite(numeric[self._finite]).all():
            return None
        out = {self._names[i]: numeric[j] for j, i in enumerate(self._numeric)}
        for i in self._literals:
            codes = self._rules[i].codes
            try:
                if not set(columns[i]) <= codes.keys():
                    return None
            except TypeError:  # an unhashable value
                return None
            out[self._names[i]] = np.fromiter(map(codes.__getitem__, columns[i]), np.int8, len(items))
        return out

    def decode_matrix(self, matrix: np.ndarray) -> dict[str, np.ndarray]:
        """Columns of a rows × fields float64 matrix (fields in the model's order, a literal as
        the index of its value, integers as integral values); raises :class:`RowError` for the
        first invalid row, with pydantic's message for that row as a JSON object."""
        if matrix.ndim != 2 or matrix.shape[1] != len(self._names):
            raise ValueError(f"expected rows × {len(self._names)} values, got shape {matrix.shape}")
        columns = self._fast_matrix_columns(matrix)
        if columns is not None:
            return columns
        return self.decode([self._matrix_item(values) for values in matrix.tolist()])

    def _fast_matrix_columns(self, matrix: np.ndarray) -> dict[str, np.ndarray] | None:
        """The columns if every value passes the vectorised check, else None."""
        with np.errstate(invalid="ignore"):
            numeric = matrix[:, self._numeric].T
            if not ((numeric >= self._low) & (numeric <= self._high)).all():
                return None
            if self._finite and not np.isfinite(numeric[self._finite]).all():
                return None
            ints = matrix[:, self._ints]
            if not (np.floor(ints) == ints).all():
                return None
            literals = matrix[:, self._literals]
            sizes = np.array([len(self._rules[i].codes) for i in self._literals])
            if not ((literals >= 0) & (literals < sizes) & (np.floor(literals) == literals)).all():
                return None
        out = {self._names[i]: numeric[j] for j, i in enumerate(self._numeric)}
        for j, i in enumerate(self._literals):
            out[self._names[i]] = literals[:, j].astype(np.int8)
        return out

    def _matrix_item(self, values: list[float]) -> dict[str, Any]:
        """One matrix row as the JSON object it stands for, for pydantic to judge: an integral
        value of an integer field as an int, a literal's index as its value; anything else as
        the float it is, which pydantic refuses with its own message."""
        item: dict[str, Any] = {}
        for rule, value in zip(self._rules, values, strict=True):
            integral = math.isfinite(value) and value == math.floor(value)
            if rule.kind == "int" and integral:
                item[rule.name] = int(value)
            elif rule.kind == "literal" and integral and 0 <= value < len(rule.codes):
                item[rule.name] = list(rule.codes)[int(value)]
            else:
                item[rule.name] = value
        return item

    def _with_defaults(self, item: dict[str, Any]) -> dict[str, Any]:
        if not item.keys() <= self._known:
            raise _FastCheckFailed
        return {**self._defaults, **item}

    def _validate_each(self, items: Sequence[Any]) -> tuple[dict[int, BaseModel], dict[int, RowError]]:
        models: dict[int, BaseModel] = {}
        errors: dict[int, RowError] = {}
        for index, item in enumerate(items):
            try:
                models[index] = self.model.model_validate(item)
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                field = ".".join(str(part) for part in first["loc"])
                errors[index] = RowError(index, field, first["msg"], first["type"])
        return models, errors


def _columns_of_models(model: type[BaseModel], rows: Sequence[BaseModel]) -> dict[str, np.ndarray]:
    columns: dict[str, np.ndarray] = {}
    for name, info in model.model_fields.items():
        values = [getattr(row, name) for row in rows]
        if typing.get_origin(info.annotation) is Literal:
            codes = typing.get_args(info.annotation)
            columns[name] = np.array([codes.index(v) for v in values], dtype=np.int8)
        else:
            columns[name] = np.array(values, dtype=np.float64)
    return columns


FEATURE_ROW_DECODER = ColumnDecoder(FeatureRow)
TRAINING_SAMPLE_DECODER = ColumnDecoder(TrainingSample)


def decode_feature_rows(items: Sequence[Any]) -> np.ndarray:
    """Model input for parsed JSON feature rows, as ``feature_matrix`` would build it from
    validated rows; raises :class:`RowError` naming the first invalid row and field."""
    return matrix_from_columns(FEATURE_ROW_DECODER.decode(items))


def decode_feature_matrix(matrix: np.ndarray) -> np.ndarray:
    """Model input for a binary call's feature matrix (:mod:`wire.latency_binary`); raises
    :class:`RowError` naming the first invalid row and field, as for JSON rows."""
    return matrix_from_columns(FEATURE_ROW_DECODER.decode_matrix(matrix))


def decode_feature_rows_partial(items: Sequence[Any]) -> tuple[np.ndarray, dict[int, RowError]]:
    """Model input for every row (an invalid row's line is meaningless) and the errors by index."""
    columns, errors = FEATURE_ROW_DECODER.decode_valid(items)
    return matrix_from_columns(columns), errors
