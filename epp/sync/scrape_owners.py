"""Which replica scrapes which endpoint: rendezvous (highest-random-weight) hashing.

Each endpoint goes to the replica whose hash of ``(replica, endpoint)`` is highest. Every
replica that knows the same set of replicas computes the same owner with no coordination, and
when a replica joins or leaves only the endpoints it gains or loses move (about 1/K of them).
The hash is BLAKE2b of the two UTF-8 names, NUL-separated (a name holds no NUL), so it is the
same in every process and version (Python's ``hash`` of a str is salted per process).
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b


def weight(replica: str, endpoint: str) -> int:
    """The rendezvous weight of ``replica`` for ``endpoint``: 64 bits, the same everywhere."""
    digest = blake2b(f"{replica}\0{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(endpoint: str, replicas: Iterable[str]) -> str:
    """The replica among ``replicas`` (at least one) that scrapes ``endpoint``: the highest
    weight; on a tie of 64-bit weights, the greater name, so that every replica agrees."""
    return max(replicas, key=lambda replica: (weight(replica, endpoint), replica))


class ScrapeOwners:
    """The owners of endpoints among one set of replicas, computed once per endpoint and kept
    until the set changes (the scraper asks on every tick of every endpoint)."""

    def __init__(self) -> None:
        self._replicas: frozenset[str] = frozenset()
        self._owners: dict[str, str] = {}

    def owner(self, endpoint: str, replicas: frozenset[str]) -> str:
        """:func:`owner` of ``endpoint`` among ``replicas`` (not empty)."""
        if replicas != self._replicas:
            self._replicas, self._owners = replicas, {}
        found = self._owners.get(endpoint)
        if found is None:
            found = self._owners[endpoint] = owner(endpoint, replicas)
        return found

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool (pods come and go under new names: keep only the live)."""
        self._owners.pop(endpoint, None)
