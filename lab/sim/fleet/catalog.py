"""Routers by name: every shipped EndpointPickerConfig (``epp/configs/*.yaml``), plus ``oracle``.

A config added to ``epp/configs`` is benchmarked without more code.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.configs import CONFIG_DIR
from sim.fleet.flow_gate import flow_controlled_router
from sim.fleet.oracle import OracleRouter
from sim.fleet.router_replicas import ReplicatedRouter
from sim.fleet.routers import Router

ORACLE = "oracle"


def router_names() -> list[str]:
    """Every shipped config's name, then ``oracle``."""
    return [*sorted(path.stem for path in CONFIG_DIR.glob("*.yaml")), ORACLE]


def make_router(
    name: str,
    clock: Callable[[], float],
    seed: int,
    *,
    router_replicas: int = 1,
    sync_delay_s: float | None = None,
    share_scrapes: bool = False,
) -> Router:
    """The router called ``name``: ``oracle``, a config's name, or a config file path.

    With ``router_replicas`` > 1 or a ``sync_delay_s``, the config runs as that many EPP
    replicas (``sim.fleet.router_replicas``), synced with that delay (None: never synced),
    sharing their scrapes if ``share_scrapes``."""
    if name == ORACLE:
        if router_replicas != 1 or sync_delay_s is not None:
            raise ValueError("the oracle is one clairvoyant router; it has no replicas to sync")
        return OracleRouter()
    shipped = CONFIG_DIR / f"{name}.yaml"
    config, label = (str(shipped), name) if shipped.is_file() else (name, None)
    if router_replicas == 1 and sync_delay_s is None:
        return flow_controlled_router(config, clock, seed, name=label)
    return ReplicatedRouter(
        config,
        clock,
        seed,
        replicas=router_replicas,
        sync_delay_s=sync_delay_s,
        name=label,
        share_scrapes=share_scrapes,
    )
