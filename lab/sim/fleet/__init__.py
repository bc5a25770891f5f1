"""Fleet simulator: N simulated vLLM engines in virtual time, routed by the real EPP scheduling core.

``workload`` says what is replayed (sessions of turns), ``prompts`` turns each turn into token ids
with real shared prefixes, ``replica`` advances one engine, ``routers`` wraps an
EndpointPickerConfig pipeline and drives the live EPP's request lifecycle
(``epp.requestcontrol.lifecycle``) in virtual time (or is the clairvoyant ``oracle``),
``router_replicas`` runs K EPP replicas of one config synced through ``epp.sync`` with a
virtual-time delay, ``predictor`` runs the trainer and predictor in process, and ``simulator`` is
the discrete-event loop that drives time and ties them together.
"""

from sim.fleet.catalog import ORACLE, make_router, router_names
from sim.fleet.simulator import FleetConfig, FleetResult, FleetSimulator, ProfileSwitch, SimulatedRequest
from sim.fleet.workload import Session, Turn, Workload

__all__ = [
    "ORACLE",
    "FleetConfig",
    "FleetResult",
    "FleetSimulator",
    "ProfileSwitch",
    "Session",
    "SimulatedRequest",
    "Turn",
    "Workload",
    "make_router",
    "router_names",
]
