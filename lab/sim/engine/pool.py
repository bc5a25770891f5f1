"""A pool of engines written as one string: which profile each replica runs, with what limits.

Grammar (``--profile`` of ``llm-epp-bench compare``, ``replay`` and ``sync-sweep``)::

    POOL    := NAME | ENTRY ("," ENTRY)*
    ENTRY   := VARIANT ":" COUNT
    VARIANT := NAME ("+" KEY "=" VALUE)*

A plain ``NAME`` is today's homogeneous pool: every replica runs that profile, as many as the
command's ``--replicas``. ``NAME:COUNT,NAME:COUNT`` is a mixed pool, replicas in the order
written (``llama-3.1-8b-h100:2,llama-3.1-8b-a100:2``: replicas 0-1 on H100, 2-3 on A100); its
counts set the pool's size. ``+KEY=VALUE`` changes one profile's serving config or speed:

=========================  ====================================================================
key                        meaning
=========================  ====================================================================
max_num_seqs               vLLM's batch-slot limit
max_num_batched_tokens     the chunked-prefill token budget per step
num_gpu_blocks             the KV cache's size in blocks (KV size)
slowdown                   every step ``VALUE`` times as long (a slower engine, e.g. 2.5)
=========================  ====================================================================

so ``llama-3.1-8b-h100:2,llama-3.1-8b-h100+slowdown=2.5+max_num_seqs=64:2`` is two H100s beside
two engines 2.5 times slower with 64 batch slots. Every replica must share one KV block size
(prefix-cache block names depend on it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sim.engine.config import EngineConfigError
from sim.engine.profile import Profile, ProfileError, load_profile

PROFILE_LABEL = "llm-epp.io/profile"
"""The endpoint label under which a simulated replica carries its pool entry's variant, as a real
pod carries its accelerator type (the ``endpointClassLabel`` of ``predicted-latency-producer``)."""
ENGINE_OVERRIDES = ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks")
OVERRIDES = (*ENGINE_OVERRIDES, "slowdown")


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """``count`` replicas of profile ``variant`` (its name with any ``+KEY=VALUE`` overrides)."""

    variant: str
    count: int


def parse_pool(spec: str) -> tuple[PoolEntry, ...] | None:
    """The entries of a mixed pool, or None for a plain profile name (a homogeneous pool).

    Raises ProfileError on a malformed spec (an entry without a count, a count below 1)."""
    text = spec.strip()
    if ":" not in text:
        return None
    entries = []
    for part in text.split(","):
        variant, sep, count = part.strip().rpartition(":")
        if not sep or not variant or not count.strip().isdigit() or int(count) < 1:
            raise ProfileError(f"pool entry {part.strip()!r} is not NAME:COUNT with COUNT >= 1")
        entries.append(PoolEntry(variant.strip(), int(count)))
    return tuple(entries)


def load_variant(variant: str) -> Profile:
    """Profile ``NAME`` with its ``+KEY=VALUE`` overrides applied; its name is ``variant``."""
    name, *overrides = variant.split("+")
    profile = load_profile(name)
    engine_changes: dict[str, int] = {}
    slowdown = 1.0
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or key not in OVERRIDES:
            raise ProfileError(f"{variant!r}: overrides are +KEY=VALUE with KEY among {', '.join(OVERRIDES)}")
        try:
            if key == "slowdown":
                slowdown = float(value)
            else:
                engine_changes[key] = int(value)
        except ValueError:
            raise ProfileError(f"{variant!r}: {key} must be a number, got {value!r}") from None
    if not 0 < slowdown < math.inf:
        raise ProfileError(f"{variant!r}: slowdown must be a positive finite number")
    try:
        engine = dataclasses.replace(profile.engine, **engine_changes)
    except EngineConfigError as exc:
        raise ProfileError(f"{variant!r}: {exc}") from None
    if not overrides:
        return profile
    return dataclasses.replace(profile, name=variant, engine=engine, cost=profile.cost.scaled(slowdown))


def pool_variants(spec: str, replicas: int) -> list[str]:
    """Each replica's profile variant, in replica order: ``replicas`` of a plain name, or a mixed
    pool's entries (whose counts must then sum to ``replicas``)."""
    entries = parse_pool(spec)
    if entries is None:
        return [spec.strip()] * replicas
    if sum(entry.count for entry in entries) != replicas:
        raise ProfileError(f"pool {spec!r} has {pool_size(spec)} replicas, not {replicas}")
    return [entry.variant for entry in entries for _ in range(entry.count)]


def pool_profiles(spec: str, replicas: int) -> list[Profile]:
    """Each replica's loaded profile, in replica order (see ``pool_variants``)."""
    variants = pool_variants(spec, replicas)
    loaded = {variant: load_variant(variant) for variant in dict.fromkeys(variants)}
    profiles = [loaded[variant] for variant in variants]
    if len({profile.engine.block_size for profile in profiles}) > 1:
        raise ProfileError(f"pool {spec!r} mixes KV block sizes; its replicas must share one")
    return profiles


def pool_size(spec: str) -> int | None:
    """A mixed pool's replica count; None for a plain name (the caller's ``--replicas`` decide)."""
    entries = parse_pool(spec)
    return None if entries is None else sum(entry.count for entry in entries)


def check_pool(spec: str) -> None:
    """Raise ProfileError unless every profile and override in ``spec`` loads."""
    pool_profiles(spec, pool_size(spec) or 1)


def describe_pool(profiles: list[Profile]) -> list[dict[str, object]]:
    """Each distinct profile of a pool, in replica order, with how many replicas run it."""
    counts: dict[str, int] = {}
    first: dict[str, Profile] = {}
    for profile in profiles:
        counts[profile.name] = counts.get(profile.name, 0) + 1
        first.setdefault(profile.name, profile)
    return [
        {"name": name, "replicas": counts[name], "description": p.description, "source": p.source}
        for name, p in first.items()
    ]
