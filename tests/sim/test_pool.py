"""Pool specs: a plain profile, or NAME[+KEY=VALUE...]:COUNT entries, each replica's profile."""

from __future__ import annotations

import pytest

from sim.engine import ProfileError, load_profile
from sim.engine.pool import describe_pool, load_variant, parse_pool, pool_profiles, pool_size, pool_variants


def test_a_plain_name_is_a_homogeneous_pool_of_the_callers_size() -> None:
    assert parse_pool("llama-3.1-8b-h100") is None and pool_size("llama-3.1-8b-h100") is None
    profiles = pool_profiles("llama-3.1-8b-h100", 3)
    assert [p.name for p in profiles] == ["llama-3.1-8b-h100"] * 3
    assert profiles[0] == load_profile("llama-3.1-8b-h100")


def test_a_mixed_pool_lists_replicas_in_the_order_written() -> None:
    spec = "llama-3.1-8b-h100:2, llama-3.1-8b-a100:1"
    assert pool_size(spec) == 3
    assert pool_variants(spec, 3) == ["llama-3.1-8b-h100", "llama-3.1-8b-h100", "llama-3.1-8b-a100"]
    fast, _, slow = pool_profiles(spec, 3)
    assert slow.cost.step_time(0, 0, 1, 100, 0.0) > 2.5 * fast.cost.step_time(0, 0, 1, 100, 0.0)
    assert [(d["name"], d["replicas"]) for d in describe_pool(pool_profiles(spec, 3))] == [
        ("llama-3.1-8b-h100", 2),
        ("llama-3.1-8b-a100", 1),
    ]


def test_overrides_change_serving_config_and_speed() -> None:
    base = load_profile("llama-3.1-8b-h100")
    variant = load_variant(
        "llama-3.1-8b-h100+max_num_seqs=64+max_num_batched_tokens=2048+num_gpu_blocks=5000"
    )
    assert variant.name == "llama-3.1-8b-h100+max_num_seqs=64+max_num_batched_tokens=2048+num_gpu_blocks=5000"
    assert (variant.engine.max_num_seqs, variant.engine.max_num_batched_tokens) == (64, 2048)
    assert variant.engine.num_gpu_blocks == 5000 and variant.cost == base.cost
    slow = load_variant("llama-3.1-8b-h100+slowdown=2.5")
    assert slow.engine == base.engine
    assert slow.cost.step_time(512, 0, 8, 4000, 0.1) == pytest.approx(
        2.5 * base.cost.step_time(512, 0, 8, 4000, 0.1)
    )


@pytest.mark.parametrize(
    ("spec", "replicas", "message"),
    [
        ("llama-3.1-8b-h100:2,llama-3.1-8b-a100", 3, "NAME:COUNT"),
        ("llama-3.1-8b-h100:0", 0, "COUNT >= 1"),
        ("llama-3.1-8b-h100:two", 2, "NAME:COUNT"),
        ("llama-3.1-8b-h100:2", 3, "has 2 replicas, not 3"),
        ("nope:1", 1, "unknown profile"),
        ("llama-3.1-8b-h100+batch=4:1", 1, "KEY among"),
        ("llama-3.1-8b-h100+max_num_seqs=x:1", 1, "must be a number"),
        ("llama-3.1-8b-h100+max_num_seqs=0:1", 1, "max_num_seqs"),
        ("llama-3.1-8b-h100+slowdown=inf:1", 1, "positive finite"),
        ("llama-3.1-8b-h100:1,tiny-cpu-amx:1", 2, "block sizes"),
    ],
)
def test_malformed_pools_are_refused(spec: str, replicas: int, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        pool_profiles(spec, replicas)
