from __future__ import annotations

import pytest

from epp.errors import BadRequest
from epp.requestcontrol.request_headers import RequestHints, parse_request_hints


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
        ("x-prediction-based-scheduling", "maybe"),
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
