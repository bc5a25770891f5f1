"""The fleet simulator: determinism, conservation, the lifecycle the router sees, the oracle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from epp.kvcache.block_hash import chain_hashes
from sim.fleet import FleetConfig, FleetSimulator, Session, Turn, Workload, make_router
from sim.fleet.prompts import PromptBuilder
from tests.fleet.sessions import fingerprint, random_sessions


def _run(router: str, workload: Workload, **config: object):
    settings = FleetConfig(**{"replicas": 3, "profile": "llama-3.1-8b-h100", **config})  # type: ignore[arg-type]
    return FleetSimulator(workload, lambda clock: make_router(router, clock, 7), settings).run()


@pytest.mark.parametrize("router", ["gie-default", "random", "oracle"])
def test_same_seed_same_run(router: str) -> None:
    workload = Workload("t", random_sessions(12, 3, seed=1))
    assert fingerprint(_run(router, workload)) == fingerprint(_run(router, workload))


def test_predicted_latency_retrains_in_virtual_time_and_stays_deterministic() -> None:
    workload = Workload("t", random_sessions(60, 3, seed=2, spread_s=20.0), slo_ttft_ms=500, slo_tpot_ms=50)
    first = _run("predicted-latency", workload, retrain_interval_s=2.0)
    assert first.retrains >= 2
    assert any(r.predicted_ttft_ms is not None for r in first.records)
    assert fingerprint(first) == fingerprint(_run("predicted-latency", workload, retrain_interval_s=2.0))


def test_every_request_completes_or_is_rejected() -> None:
    sessions = random_sessions(20, 4, seed=3)
    # one prompt longer than the model's context: the engine refuses it, the session goes on
    sessions.append(Session("huge", 1.0, (Turn(200_000, 10), Turn(100, 5, prefix="previous"))))
    result = _run("gie-default", Workload("t", sessions))
    assert len(result.records) == sum(len(s.turns) for s in sessions)
    for record in result.records:
        assert record.completed != (record.rejected is not None)
        if record.completed:
            assert record.arrival <= record.first_token <= record.finish
    assert [r.rejected for r in result.records if r.session_id == "huge"] == ["engine_refused", None]


def test_later_turns_hit_the_prefix_cache_of_the_previous_turn() -> None:
    sessions = [
        Session("a", 0.0, (Turn(3000, 50), Turn(3500, 50, prefix="previous", think_s=1.0))),
    ]
    result = _run("random", Workload("t", sessions), replicas=1)
    first, second = result.records
    # the whole first prompt and the generated tokens before the last block boundary are cached
    assert second.cached_tokens >= (3000 + 49) // 16 * 16 - 16
    assert first.cached_tokens == 0


def test_prompt_builder_digests_are_the_engines() -> None:
    builder = PromptBuilder(16, 512)
    tokens, digests = builder.blocks([1, 2, 3], 1300)
    assert digests == chain_hashes(tokens, 16)
    again, again_digests = builder.blocks([1, 2, 4], 1536)
    assert again[:1024] == tokens[:1024] and again_digests[:64] == digests[:64]
    assert again_digests == chain_hashes(again, 16)


def test_oracle_beats_random_when_overloaded() -> None:
    """Long prompts (up to 30k tokens) at 5 requests/s on three 8B replicas: queues form, and the
    prefills stall the decoding batches; knowing the true state avoids the worst collisions."""
    rng = random.Random(5)
    sessions, now = [], 0.0
    for index in range(200):
        now += rng.expovariate(5.0)
        turn = Turn(rng.randint(2000, 30000), rng.choice([20, 100, 1000]))
        sessions.append(Session(f"r{index}", now, (turn,)))
    workload = Workload("overload", sessions)

    def means(router: str) -> tuple[float, float]:
        records = _run(router, workload).records
        return (
            sum(r.e2e for r in records) / len(records),
            sum(r.tpot for r in records if r.tpot) / sum(1 for r in records if r.tpot),
        )

    oracle, random_ = means("oracle"), means("random")
    assert oracle[0] < 0.95 * random_[0]
    assert oracle[1] < 0.8 * random_[1]


def test_a_mixed_pool_runs_each_replica_on_its_own_profile() -> None:
    """One H100 beside one engine three times slower: the same lone requests take about three
    times as long to prefill there; the oracle, knowing it, sends every lone request to the fast one."""
    sessions = [Session(f"r{i}", 5.0 * i, (Turn(4000, 2),)) for i in range(12)]
    workload = Workload("lone", sessions)
    pool = "llama-3.1-8b-h100:1,llama-3.1-8b-h100+slowdown=3:1"
    spread = _run("random", workload, replicas=2, profile=pool)
    assert spread.replica_profiles == ["llama-3.1-8b-h100", "llama-3.1-8b-h100+slowdown=3"]
    ttft = {index: [r.ttft for r in spread.records if r.replica == index] for index in (0, 1)}
    assert ttft[0] and ttft[1]
    assert min(ttft[1]) > 2.5 * max(ttft[0])
    assert {r.replica for r in _run("oracle", workload, replicas=2, profile=pool).records} == {0}


def test_a_late_replica_is_offered_only_after_it_joins() -> None:
    sessions = [Session(f"r{i}", 0.5 * i, (Turn(500, 5),)) for i in range(40)]
    result = _run("least-request", Workload("join", sessions), replicas=3, joins_at_s=(10.0,))
    late = [r.arrival for r in result.records if r.replica == 2]
    assert late and min(late) >= 10.0
    assert any(r.replica != 2 for r in result.records if r.arrival >= 10.0)
    with pytest.raises(ValueError, match="from the start"):
        _run("random", Workload("join", sessions), replicas=1, joins_at_s=(1.0,))


def test_measured_speeds_send_a_slow_replica_its_share_of_the_work(tmp_path: Path) -> None:
    """Dynamo's token-load cost on one H100 beside one 3x slower, a request every 100 ms: counted
    in tokens, the slow one is sent about a quarter of the requests (it holds each one longer);
    with ``endpoint-speed-producer`` the cost counts time, and a request waits where its work
    ends sooner, mostly on the fast one."""
    sessions = [Session(f"r{i}", 0.1 * i, (Turn(2000, 200),)) for i in range(300)]
    pool = "llama-3.1-8b-h100:1,llama-3.1-8b-h100+slowdown=3:1"
    shipped = (Path(__file__).parents[2] / "epp/configs/dynamo-kv-t0.yaml").read_text()
    timed = tmp_path / "dynamo-kv-timed.yaml"
    producer = "- type: token-load-producer\n"
    timed.write_text(shipped.replace(producer, producer + "- type: endpoint-speed-producer\n"))

    def slow_share(router: str) -> float:
        records = _run(router, Workload("steady", sessions), replicas=2, profile=pool).records
        return sum(r.replica == 1 for r in records) / len(records)

    in_tokens, in_time = slow_share("dynamo-kv-t0"), slow_share(str(timed))
    assert in_tokens > 0.2
    assert in_time < 0.7 * in_tokens
