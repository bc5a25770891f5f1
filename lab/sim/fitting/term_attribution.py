"""Which step-time terms make a profile's TPOT climb with load: the fidelity workload in virtual time.

``llm-epp-bench fidelity`` runs the simulator in real time beside real vLLM, where other work on
the machine moves every figure. This replays the same seeded workload (``FidelitySettings``: the
same prompt and output lengths and Poisson arrivals, at given rates) through the simulated engine
alone, in virtual time, so the profile's own TTFT and TPOT at each load come out the same on any
machine; and again with each step term set to 0 in turn. The difference a term makes at each
load is its share of the climb.

``python -m sim.fitting.term_attribution [PROFILE] [--rates 2.9,7.7,13.5]`` prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Sequence

import numpy as np

from sim.engine import EngineRequest, Profile, load_profile
from sim.engine.offline import distinct_prompt, serve_offline
from sim.fitting.profile_fit import STEP_TERMS

TERMS = STEP_TERMS
DEFAULT_RATES = (2.9, 7.7, 13.5)
"""Requests per second of the three levels of issue 28's run (0.15, 0.4, 0.7 of 19.3 req/s)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def workload(rate: float, seconds: float = 25.0, seed: int = 42) -> list[Request]:
    """The fidelity bench's workload shape (``sim.fitting.workload.poisson_workload``'s lengths and
    arrivals for the same seed), without the prompt texts."""
    rng = random.Random(seed)
    requests, now = [], 0.0
    for _ in range(max(10, round(rate * seconds))):
        now += rng.expovariate(rate)
        requests.append(Request(now, rng.randint(50, 1500), rng.randint(16, 256)))
    return requests


def without(profile: Profile, term: str) -> Profile:
    """``profile`` with one step term (``TERMS``) set to 0."""
    cost = profile.cost
    if term == "base":
        return dataclasses.replace(profile, cost=dataclasses.replace(cost, base=0.0))
    group, name = term.split(".")
    terms = dataclasses.replace(getattr(cost, group), **{name: 0.0})
    return dataclasses.replace(profile, cost=dataclasses.replace(cost, **{group: terms}))


def replay(profile: Profile, requests: Sequence[Request]) -> tuple[float, float]:
    """TTFT p50 and TPOT p50 (ms) of ``requests`` on one simulated engine, in virtual time, with
    the profile's front-end delay (no other request running, as at light load)."""
    served = [
        EngineRequest(f"r{i}", distinct_prompt(i, r.prompt_tokens), r.output_tokens)
        for i, r in enumerate(requests)
    ]
    serve_offline(
        profile,
        [
            (r.arrival_s + profile.frontend.delay(r.prompt_tokens, 0), s)
            for r, s in zip(requests, served, strict=True)
        ],
    )
    ttft = [s.first_token_time - r.arrival_s for r, s in zip(requests, served, strict=True)]
    tpot = [
        (s.finish_time - s.first_token_time) / (r.output_tokens - 1)
        for r, s in zip(requests, served, strict=True)
        if r.output_tokens > 1
    ]
    return 1000 * float(np.median(ttft)), 1000 * float(np.median(tpot))


def attribution(profile: Profile, rates: Sequence[float]) -> dict[str, list[float]]:
    """TPOT p50 (ms) at each rate: ``"as fitted"`` and without each term that is not 0."""
    # Level i of the fidelity bench uses seed 42 + i.
    workloads = [workload(rate, seed=42 + index) for index, rate in enumerate(rates)]
    rows = {"as fitted": [replay(profile, w)[1] for w in workloads]}
    for term in TERMS:
        variant = without(profile, term)
        if variant.cost != profile.cost:
            rows[f"without {term}"] = [replay(variant, w)[1] for w in workloads]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sim.fitting.term_attribution", description=__doc__.splitlines()[0]
    )
    parser.add_argument("profile", nargs="?", default="tiny-cpu")
    parser.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)))
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    profile = load_profile(args.profile)
    print(f"{profile.name}: TPOT p50 (ms) in virtual time at {', '.join(f'{r:g}' for r in rates)} req/s\n")
    print("| step model | " + " | ".join(f"{r:g} req/s" for r in rates) + " | climb |")
    print("|---" * (len(rates) + 2) + "|")
    for name, tpots in attribution(profile, rates).items():
        climb = 100 * (tpots[-1] / tpots[0] - 1)
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in tpots) + f" | {climb:+.0f}% |")


if __name__ == "__main__":
    main()
