"""The header that names the EPP replica which routed a request.

With several replicas the gateway logs every request to each of them (one access logger per
replica, ``sim.envoy_config.with_epp_replicas``). A replica finishes only the requests it
routed and counts the rest as unknown, so without a way to tell them apart each replica would
read the whole pool's log: a cost that grows with the replicas. The replica puts its id in the
forwarded request's headers, which the access log sees, and each logger keeps the entries of
its own replica only.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.scheduling.observers import LifecycleObserver, RoutedRequest

REPLICA_HEADER = "x-llm-epp-replica"


class ReplicaHeader(LifecycleObserver):
    """Adds :data:`REPLICA_HEADER` with this replica's id to every request it forwards."""

    def __init__(self, replica_id: str) -> None:
        self._headers = {REPLICA_HEADER: replica_id}

    def upstream_headers(self, routed: RoutedRequest) -> Mapping[str, str]:
        return self._headers
