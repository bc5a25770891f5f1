"""EPP replicas as far as sync goes, and a nats-server a test can stop and start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from epp.load.peer_totals import PeerTotals
from epp.load.token_load import TokenLoadTracker
from epp.sync.state import ReplicaSyncState
from sim.nats_server import start_nats_server
from sim.processes import Component, free_port

ENDPOINTS = ("a", "b", "c")


@dataclass
class EppReplica:
    """One EPP replica as far as sync goes: its own bookings and its sync state."""

    sync: ReplicaSyncState
    own: TokenLoadTracker = field(default_factory=TokenLoadTracker)
    next_key: int = 0

    @property
    def peers_load(self) -> PeerTotals:
        assert self.sync.targets.token_load is not None
        return self.sync.targets.token_load

    def route(self, endpoint: str, prompt: int, cached: int, expected: int, slo: float | None = None) -> int:
        key = self.next_key
        self.next_key += 1
        self.own.admit(key, endpoint, prompt, cached, expected)
        terms = self.own.terms(key)
        assert terms is not None
        self.sync.routed(
            key,
            endpoint,
            kv_tokens=terms.prompt_tokens,
            uncached_tokens=terms.uncached_tokens,
            expected_output=terms.expected_output,
            tpot_slo_ms=slo,
        )
        return key

    def first_token(self, key: int) -> None:
        self.own.first_token(key)
        self.sync.first_token(key)

    def progress(self, key: int, generated: int) -> None:
        self.own.progress(key, generated)
        self.sync.progress(key, generated)

    def release(self, key: int) -> None:
        self.own.finish(key)
        self.sync.released(key)


class Nats:
    """A nats-server on a free port that a test can stop and start again on the same port."""

    def __init__(self, workdir: Path, args: tuple[str, ...] = ()) -> None:
        self.workdir, self.args, self.port = workdir, args, free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.component: Component | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.component = start_nats_server(
            self.workdir, self.port, name=f"nats-{self.starts}", args=self.args
        )

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()
