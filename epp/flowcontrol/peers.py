"""Peer EPP replicas' token load, as flow control counts it when replicas sync (``epp.sync``).

Each replica's flow controller books only what it dispatched itself. With active-active replicas
its :class:`~epp.sync.state.ReplicaSyncState` applies the peers' published totals to the token-load
producer's ``peers``; :class:`PeerTokenLoad` reads them from there, per endpoint and in the
terms of the controller's own bookings, with the number of replicas sharing the pool, so the
token-load detector counts the whole pool's in-flight tokens and keeps this replica its 1/K
share of the headroom (``epp.flowcontrol.saturation``). The live EPP and the fleet simulator
both hand their controllers one of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from epp.scheduling.types import EndpointState
from epp.sync.state import ReplicaSyncState


class PeerLoad(NamedTuple):
    """What a saturation detector sees of the peers (``PoolView``'s peer fields)."""

    tokens: Mapping[str, int]
    """Per endpoint, the peers' KV tokens plus the output they still expect there."""
    prefill_tokens: Mapping[str, int]
    """Per endpoint, the peers' uncached prompt tokens still to prefill."""
    replicas: int
    """EPP replicas sharing the pool, this one included."""


NO_PEERS = PeerLoad({}, {}, 1)
"""A replica on its own."""


class PeerTokenLoad:
    def __init__(self, sync: ReplicaSyncState) -> None:
        """The peers' load as ``sync`` applied it; :class:`ValueError` when the config has no
        token-load producer (its ``peers`` is where the peers' load goes)."""
        tracker = sync.targets.token_load
        if tracker is None:
            raise ValueError(
                "pool-wide token load needs a token-load-producer in the config (it holds the peers')"
            )
        self._sync = sync
        self._tracker = tracker

    def read(self, endpoints: Sequence[EndpointState]) -> PeerLoad:
        """The peers' load on ``endpoints`` now; the replicas are this one and the peers heard
        from within their timeout, so a peer that goes silent gives its share back."""
        loads = {e.name: load for e in endpoints if (load := self._tracker.load(e.name)).requests}
        return PeerLoad(
            {name: load.kv_tokens + load.expected_remaining_tokens for name, load in loads.items()},
            {name: load.prefill_tokens for name, load in loads.items()},
            1 + len(self._sync.peers),
        )
