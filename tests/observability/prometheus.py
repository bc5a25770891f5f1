"""What the tests ask of a Prometheus server (see ``bench.harness.observed_stack``) and of PromQL
expressions."""

from __future__ import annotations

import re

import httpx


def query(prometheus_url: str, expr: str) -> list[dict]:
    """The instant vector ``expr`` evaluates to now; raise on a query Prometheus refuses."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def exported_names(prometheus_url: str) -> set[str]:
    """Every metric name Prometheus holds samples of."""
    return set(httpx.get(f"{prometheus_url}/api/v1/label/__name__/values", timeout=10).json()["data"])


_STRIP = (
    re.compile(r'"(?:[^"\\]|\\.)*"'),  # strings
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\[[^\]]*\]"),  # ranges
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
)
_IDENTIFIER = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (every identifier that is not a function, keyword or label)."""
    for pattern in _STRIP:
        expr = pattern.sub(" ", expr)
    return {name for name in _IDENTIFIER.findall(expr) if name.lower() not in _KEYWORDS}


_COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(?=[-+\d.])")


def as_signal(expr: str) -> str:
    """An alert expression with its threshold comparisons turned into ``bool`` ones, so that it
    returns a series (0 or 1) whenever its inputs have data, firing or not."""
    return _COMPARISON.sub(r"\1 bool ", expr)
