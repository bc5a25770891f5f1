"""Routers by name: every shipped EndpointPickerConfig (``epp/configs/*.yaml``), plus ``oracle``.

A config added to ``epp/configs`` is benchmarked without more code.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.configs import CONFIG_DIR
from sim.fleet.oracle import OracleRouter
from sim.fleet.routers import PipelineRouter, Router

ORACLE = "oracle"


def router_names() -> list[str]:
    """Every shipped config's name, then ``oracle``."""
    return [*sorted(path.stem for path in CONFIG_DIR.glob("*.yaml")), ORACLE]


def make_router(name: str, clock: Callable[[], float], seed: int) -> Router:
    """The router called ``name``: ``oracle``, a config's name, or a config file path."""
    if name == ORACLE:
        return OracleRouter()
    if (CONFIG_DIR / f"{name}.yaml").is_file():
        return PipelineRouter(str(CONFIG_DIR / f"{name}.yaml"), clock, seed, name=name)
    return PipelineRouter(name, clock, seed)
