"""``session-affinity`` (filter): consistent hashing of a session header onto the endpoints.

Each candidate owns ``virtualNodes`` points on a 64-bit ring (xxHash64 of ``"{name}:{i}"``);
a request's session key (xxHash64 of the header value) belongs to the first point clockwise.
Adding or removing one of N endpoints moves only about 1/N of the sessions. The filter keeps
that home endpoint alone, or, when it is saturated, the next endpoint clockwise that is not
(Ray's ConsistentHashRouter walks the same successors on backpressure). When every candidate
is saturated the home endpoint is kept. An endpoint that is gone (removed, unhealthy, or
dropped by an earlier filter) is simply not on the ring, so its sessions move to their
successors and come back when it returns. Requests without the header pass through
untouched, to be balanced by whatever follows. Put this filter first in a profile: the ring
is built from the candidates it is given.

==================  ============  ======================================================
parameter           default       meaning
==================  ============  ======================================================
headerName          x-session-id  request header holding the session key
virtualNodes        128           ring points per endpoint
seed                0             xxHash64 seed of ring points and keys
maxWaitingRequests  64            saturated at this many engine-queued requests
                                  (``vllm:num_requests_waiting``); null: no limit
maxKvCacheUsage     0.98          saturated at this KV-cache usage (fraction); null: no
                                  limit
maxTokensInFlight   null          saturated at this many prefill + decode tokens in
                                  flight (``token-load-producer``); null: no limit
==================  ============  ======================================================
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import xxhash
from pydantic import Field

from epp.load.token_load import NO_LOAD, EndpointLoad
from epp.scheduling.cycle_data import TOKEN_LOAD
from epp.scheduling.framework import CycleState, Filter, PluginContext, PluginParameters
from epp.scheduling.registry import register
from epp.scheduling.types import EndpointState, LLMRequest


class HashRing:
    """Endpoint names on a consistent-hash ring with virtual nodes."""

    __slots__ = ("_names", "_points", "seed")

    def __init__(self, names: Sequence[str], virtual_nodes: int, seed: int = 0) -> None:
        self.seed = seed
        ring = sorted(
            (xxhash.xxh64_intdigest(f"{name}:{i}".encode(), seed), name)
            for name in names
            for i in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._names = [name for _, name in ring]

    def successors(self, key: str) -> Iterator[str]:
        """Every endpoint once, clockwise from ``key``'s position: the owner first."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, xxhash.xxh64_intdigest(key.encode(), self.seed))
        seen: set[str] = set()
        count = len(self._points)
        for offset in range(count):
            name = self._names[(start + offset) % count]
            if name not in seen:
                seen.add(name)
                yield name


class SessionAffinityParameters(PluginParameters):
    header_name: str = Field(default="x-session-id", min_length=1, alias="headerName")
    virtual_nodes: int = Field(default=128, ge=1, le=4096, alias="virtualNodes")
    seed: int = Field(default=0, ge=0, lt=1 << 64)
    max_waiting_requests: int | None = Field(default=64, ge=0, alias="maxWaitingRequests")
    max_kv_cache_usage: float | None = Field(default=0.98, ge=0.0, le=1.0, alias="maxKvCacheUsage")
    max_tokens_in_flight: int | None = Field(default=None, ge=0, alias="maxTokensInFlight")


@register
class SessionAffinityFilter(Filter):
    type_name = "session-affinity"
    Parameters = SessionAffinityParameters
    consumes = (TOKEN_LOAD,)
    params: SessionAffinityParameters

    def __init__(self, name: str, params: SessionAffinityParameters, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._ring: HashRing | None = None
        self._ring_names: frozenset[str] = frozenset()

    def ring(self, names: frozenset[str]) -> HashRing:
        """The ring over ``names``, rebuilt only when the candidate set changes."""
        if self._ring is None or names != self._ring_names:
            self._ring = HashRing(sorted(names), self.params.virtual_nodes, self.params.seed)
            self._ring_names = names
        return self._ring

    def filter(
        self, request: LLMRequest, endpoints: Sequence[EndpointState], state: CycleState
    ) -> list[EndpointState]:
        key = request.headers.get(self.params.header_name.lower())
        if not key:
            return list(endpoints)
        by_name = {e.name: e for e in endpoints}
        loads = state.get(TOKEN_LOAD) or {}
        order = list(self.ring(frozenset(by_name)).successors(key))
        for name in order:
            if not self._saturated(by_name[name], loads.get(name, NO_LOAD)):
                return [by_name[name]]
        return [by_name[order[0]]]

    def _saturated(self, endpoint: EndpointState, load: EndpointLoad) -> bool:
        p, m = self.params, endpoint.metrics
        return (
            (p.max_waiting_requests is not None and m.waiting >= p.max_waiting_requests)
            or (p.max_kv_cache_usage is not None and m.kv_cache_usage >= p.max_kv_cache_usage)
            or (p.max_tokens_in_flight is not None and load.tokens_in_flight >= p.max_tokens_in_flight)
        )
