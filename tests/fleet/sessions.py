"""Random multi-turn sessions for fleet-simulator tests, and a run's per-request fingerprint."""

from __future__ import annotations

import random

from sim.fleet import Session, Turn


def random_sessions(count: int, turns: int, seed: int, *, spread_s: float = 10.0) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for index in range(count):
        first = Turn(rng.randint(200, 3000), rng.randint(1, 300))
        later = [
            Turn(
                first.input_tokens + 400 * k,
                rng.randint(1, 300),
                prefix="previous",
                think_s=rng.uniform(0, 2),
            )
            for k in range(1, turns)
        ]
        sessions.append(Session(f"s{index}", rng.uniform(0, spread_s), (first, *later)))
    return sessions


def fingerprint(result) -> list[tuple]:
    return [(r.request_id, r.replica, r.first_token, r.finish, r.cached_tokens) for r in result.records]
