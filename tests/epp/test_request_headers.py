from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from epp.errors import BadRequest
from epp.requestcontrol.request_headers import (
    EXPECTED_OUTPUT_HEADER,
    MAX_ABS_PRIORITY,
    MAX_EXPECTED_OUTPUT,
    MAX_SLO_MS,
    PRIORITY_HEADERS,
    SLO_TPOT_HEADERS,
    SLO_TTFT_HEADERS,
    RequestHints,
    parse_request_hints,
)

# The plain references: ASCII digits with at most one inner decimal point; an optional minus.
SLO_REFERENCE = re.compile(r"\A(?:\d+|\d+\.\d+)\Z", re.ASCII)
PRIORITY_REFERENCE = re.compile(r"\A-?\d+\Z", re.ASCII)
COUNT_REFERENCE = re.compile(r"\A\d+\Z", re.ASCII)
# Text that looks numeric to float()/int() or to a reader: digits of other scripts, signs,
# exponents, underscores, points, spaces and the words for non-finite numbers.
NUMERIC_LOOKING = st.lists(
    st.sampled_from([*"0123456789.-+eE_ \t\u00a0١٣０߁", "nan", "inf", "Infinity"]), max_size=12
).map("".join)
HEADER_VALUES = st.one_of(
    NUMERIC_LOOKING, st.text(max_size=12), st.from_regex(r"\A-?[0-9]{1,9}(\.[0-9]{1,4})?\Z")
)


def test_no_headers_means_no_hints() -> None:
    assert parse_request_hints({}) == RequestHints()


def test_llm_d_forms_win_over_aliases_and_values_are_parsed() -> None:
    hints = parse_request_hints(
        {"x-llm-d-slo-ttft-ms": "250", "x-slo-ttft-ms": "999", "x-slo-tpot-ms": " 12.5 ",
         "x-priority": "-1", "x-prediction-based-scheduling": "False"}
    )  # fmt: skip
    assert hints == RequestHints(slo_ttft_ms=250.0, slo_tpot_ms=12.5, priority=-1, prediction_based=False)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-slo-ttft-ms", "fast"),
        ("x-slo-ttft-ms", "-5"),
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "nan"),
        ("x-slo-ttft-ms", "inf"),
        ("x-llm-d-slo-tpot-ms", "1e12"),
        ("x-llm-d-priority", "high"),
        ("x-priority", "1.5"),
        ("x-priority", "99999999999"),
        ("x-priority", "1" * 5000),
        ("x-slo-ttft-ms", "1_000"),
        ("x-slo-tpot-ms", "١٢٣"),
        ("x-slo-ttft-ms", "1e3"),
        ("x-slo-ttft-ms", "-0"),
        ("x-slo-ttft-ms", "0.000"),
        ("x-slo-ttft-ms", "Infinity"),
        ("x-llm-d-slo-ttft-ms", "+5"),
        ("x-llm-d-slo-ttft-ms", "\u00a05"),
        ("x-llm-d-priority", "1_0"),
        ("x-llm-d-priority", "٣"),
        ("x-llm-d-priority", "+1"),
        ("x-prediction-based-scheduling", "maybe"),
        ("x-expected-output-tokens", "0"),
        ("x-expected-output-tokens", "-3"),
        ("x-expected-output-tokens", "12.5"),
        ("x-expected-output-tokens", "1e3"),
        ("x-expected-output-tokens", "long"),
        ("x-expected-output-tokens", "10000001"),
        ("x-expected-output-tokens", "9" * 5000),
    ],
)
def test_bad_values_are_400s_naming_the_header(header: str, value: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request_hints({header: value})
    assert info.value.param == header and header in info.value.message


def test_inference_objective_header_sets_priority_unless_a_priority_header_is_given() -> None:
    objectives = {"batch": -1, "chat": 10}
    assert parse_request_hints({"x-gateway-inference-objective": "batch"}, objectives).priority == -1
    assert parse_request_hints({"x-gateway-inference-objective": "unknown"}, objectives).priority == 0
    headers = {"x-gateway-inference-objective": "batch", "x-llm-d-priority": "3"}
    assert parse_request_hints(headers, objectives).priority == 3


def _accepted(headers: dict[str, str]) -> RequestHints | None:
    try:
        return parse_request_hints(headers)
    except BadRequest as error:
        (name,) = headers
        assert error.param == name and name in error.message
        return None


@pytest.mark.parametrize("name", SLO_TTFT_HEADERS + SLO_TPOT_HEADERS)
@given(value=HEADER_VALUES)
@example(value="250")
@example(value="12.5")
@example(value="0")
@example(value="3600000.0001")
def test_slo_headers_take_exactly_the_plain_decimals_in_range(name: str, value: str) -> None:
    hints = _accepted({name: value})
    plain = value.strip(" \t")
    expected = float(plain) if SLO_REFERENCE.match(plain) and 0 < float(plain) <= MAX_SLO_MS else None
    got = None if hints is None else (hints.slo_ttft_ms if "ttft" in name else hints.slo_tpot_ms)
    assert got == expected


@pytest.mark.parametrize("name", PRIORITY_HEADERS)
@given(value=HEADER_VALUES)
@example(value="-1")
@example(value="0000000000007")
@example(value="1000001")
@example(value="-1000000")
def test_priority_headers_take_exactly_the_plain_integers_in_range(name: str, value: str) -> None:
    hints = _accepted({name: value})
    plain = value.strip(" \t")
    in_range = PRIORITY_REFERENCE.match(plain) and abs(int(plain)) <= MAX_ABS_PRIORITY
    assert (None if hints is None else hints.priority) == (int(plain) if in_range else None)


def test_expected_output_header_is_read() -> None:
    assert parse_request_hints({EXPECTED_OUTPUT_HEADER: " 512\t"}).expected_output_tokens == 512
    assert parse_request_hints({}).expected_output_tokens is None


@given(value=HEADER_VALUES)
@example(value="1")
@example(value="000000000000010")
@example(value="10000000")
@example(value="10000001")
def test_expected_output_header_takes_exactly_the_plain_counts_in_range(value: str) -> None:
    hints = _accepted({EXPECTED_OUTPUT_HEADER: value})
    plain = value.strip(" \t")
    in_range = COUNT_REFERENCE.match(plain) and 1 <= int(plain) <= MAX_EXPECTED_OUTPUT
    assert (None if hints is None else hints.expected_output_tokens) == (int(plain) if in_range else None)
