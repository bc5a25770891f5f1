"""Per-request scheduling hints carried in headers: latency SLOs, priority, prediction opt-in.

=================================  =========================================================
header                             meaning
=================================  =========================================================
``x-llm-d-slo-ttft-ms``            time-to-first-token objective, ms (alias ``x-slo-ttft-ms``)
``x-llm-d-slo-tpot-ms``            time-per-output-token objective, ms (alias ``x-slo-tpot-ms``)
``x-llm-d-priority``               integer; below 0 the request may be shed (alias ``x-priority``)
``x-gateway-inference-objective``  an InferenceObjective's name: its priority applies unless a
                                   priority header is given (unknown names mean priority 0)
``x-prediction-based-scheduling``  ``true``/``false``: use predicted latency for this request
``x-expected-output-tokens``       the client's estimate of the answer's length in tokens (an
                                   integer, 1 to 10,000,000): the EPP books and predicts the
                                   request with it (``docs/output-length.md``)
``x-llm-epp-debug``                ``true``: the response carries the routing decision
                                   (``x-llm-epp-endpoint``, ``x-llm-epp-predicted-ttft-ms``,
                                   ``x-llm-epp-predicted-tpot-ms``, every candidate's
                                   ``x-llm-epp-candidates-ttft-ms``, ``x-llm-epp-prediction-fallback``)
=================================  =========================================================

A malformed value is a 400 whose message names the header; nothing is silently ignored.
Numbers are plain ASCII decimals (SLOs ``250`` or ``12.5``, priorities ``-1``, output tokens
``512``): Python's ``float()`` and ``int()`` would also take ``1_000``, ``1e3``, ``nan``,
``inf`` and digits of other scripts (``١٢``), which no client means to send.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from epp.errors import BadRequest

SLO_TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
SLO_TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
PRIORITY_HEADERS = ("x-llm-d-priority", "x-priority")
OBJECTIVE_HEADER = "x-gateway-inference-objective"
PREDICTION_HEADER = "x-prediction-based-scheduling"
DEBUG_HEADER = "x-llm-epp-debug"
EXPECTED_OUTPUT_HEADER = "x-expected-output-tokens"
MAX_EXPECTED_OUTPUT = 10_000_000
MAX_SLO_MS = 3_600_000.0
MAX_ABS_PRIORITY = 1_000_000
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_INTEGER = re.compile(r"-?[0-9]+")
_COUNT = re.compile(r"[0-9]+")
# HTTP's optional whitespace; str.strip() would also drop Unicode spaces.
_OWS = " \t"
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True, slots=True)
class RequestHints:
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    priority: int = 0
    prediction_based: bool | None = None
    debug: bool = False
    expected_output_tokens: int | None = None


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return name, value.strip(_OWS)
    return None


def _slo(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    found = _first(headers, names)
    if found is None:
        return None
    name, raw = found
    if not _DECIMAL.fullmatch(raw):
        raise BadRequest(
            f"header {name!r} must be a decimal number of milliseconds (like 250 or 12.5), got {raw[:40]!r}",
            param=name,
        )
    value = float(raw)  # a huge digit string is inf, refused below
    if not 0 < value <= MAX_SLO_MS:
        raise BadRequest(f"header {name!r} must be in (0, {MAX_SLO_MS:.0f}] ms, got {raw[:40]!r}", param=name)
    return value


def _priority(headers: Mapping[str, str], objective_priorities: Mapping[str, int]) -> int:
    found = _first(headers, PRIORITY_HEADERS)
    if found is None:
        objective = headers.get(OBJECTIVE_HEADER)
        return objective_priorities.get(objective.strip(), 0) if objective else 0
    name, raw = found
    if not _INTEGER.fullmatch(raw):
        raise BadRequest(f"header {name!r} must be an integer, got {raw[:40]!r}", param=name)
    # No priority in range has more significant digits (and int() refuses over 4,300 digits).
    value = int(raw) if len(raw.lstrip("-0")) <= len(str(MAX_ABS_PRIORITY)) else None
    if value is None or abs(value) > MAX_ABS_PRIORITY:
        raise BadRequest(f"header {name!r} must be within ±{MAX_ABS_PRIORITY}, got {raw[:40]!r}", param=name)
    return value


def _expected_output(headers: Mapping[str, str]) -> int | None:
    found = _first(headers, (EXPECTED_OUTPUT_HEADER,))
    if found is None:
        return None
    name, raw = found
    # Bounded before int(): no count in range has more digits (and int() refuses over 4,300).
    if not _COUNT.fullmatch(raw) or len(raw.lstrip("0")) > len(str(MAX_EXPECTED_OUTPUT)):
        raise BadRequest(
            f"header {name!r} must be a whole number of tokens (like 512), got {raw[:40]!r}", param=name
        )
    value = int(raw)
    if not 1 <= value <= MAX_EXPECTED_OUTPUT:
        raise BadRequest(
            f"header {name!r} must be in [1, {MAX_EXPECTED_OUTPUT}], got {raw[:40]!r}", param=name
        )
    return value


def _boolean(headers: Mapping[str, str], name: str) -> bool | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = _BOOLEANS.get(raw.strip(_OWS).lower())
    if value is None:
        raise BadRequest(f"header {name!r} must be true or false, got {raw[:40]!r}", param=name)
    return value


def parse_request_hints(
    headers: Mapping[str, str], objective_priorities: Mapping[str, int] | None = None
) -> RequestHints:
    """Read the scheduling hints; raise :class:`BadRequest` naming the first malformed header.
    ``objective_priorities`` maps InferenceObjective names to their priorities."""
    return RequestHints(
        slo_ttft_ms=_slo(headers, SLO_TTFT_HEADERS),
        slo_tpot_ms=_slo(headers, SLO_TPOT_HEADERS),
        priority=_priority(headers, objective_priorities or {}),
        prediction_based=_boolean(headers, PREDICTION_HEADER),
        debug=bool(_boolean(headers, DEBUG_HEADER)),
        expected_output_tokens=_expected_output(headers),
    )
