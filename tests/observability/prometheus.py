"""A real Prometheus server for the tests (Debian's ``prometheus`` package, which ``make test``
installs), and what the tests ask of PromQL expressions."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import yaml

from sim.processes import Component, http_ok, spawn, wait_until


def system_binary(name: str) -> str:
    """The path of ``name`` from the system packages; a clear error when the install step is missing."""
    path = shutil.which(name)
    if path is None:
        # A missing install step is an error to fix, not a reason to skip.
        raise RuntimeError(f"{name} is not installed: run `make system-packages` (make test runs it)")
    return path


def start_prometheus(workdir: Path, port: int, targets: Mapping[str, Sequence[str]]) -> Component:
    """Prometheus on loopback ``port`` scraping every second ``targets`` (job → host:port list,
    path /metrics); the caller stops it."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
            for job, addresses in targets.items()
        ],
    }
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [
        system_binary("prometheus"),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={workdir / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.console.templates=/dev/null",
        "--web.console.libraries=/dev/null",
    ]
    server = spawn("prometheus", argv, workdir)
    wait_until(server, http_ok(f"http://127.0.0.1:{port}/-/ready"), timeout=60)
    return server


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
