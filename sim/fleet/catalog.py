"""Routers by name: every shipped EndpointPickerConfig (``epp/configs/*.yaml``), plus ``oracle``.

A config added to ``epp/configs`` is benchmarked without more code. ``sim/fleet/configs`` holds
baselines the benchmark needs that epp does not ship (yet); a shipped config of the same name
takes precedence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from epp.configs import CONFIG_DIR
from sim.fleet.oracle import OracleRouter
from sim.fleet.routers import PipelineRouter, Router

ORACLE = "oracle"
BASELINE_DIR = Path(__file__).parent / "configs"


def router_names() -> list[str]:
    """Every shipped config's name and every baseline's, then ``oracle``."""
    names = {path.stem for directory in (CONFIG_DIR, BASELINE_DIR) for path in directory.glob("*.yaml")}
    return [*sorted(names), ORACLE]


def make_router(name: str, clock: Callable[[], float], seed: int) -> Router:
    """The router called ``name``: ``oracle``, a config's name, or a config file path."""
    if name == ORACLE:
        return OracleRouter()
    for directory in (CONFIG_DIR, BASELINE_DIR):
        if (directory / f"{name}.yaml").is_file():
            return PipelineRouter(str(directory / f"{name}.yaml"), clock, seed, name=name)
    return PipelineRouter(name, clock, seed)
