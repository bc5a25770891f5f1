"""The routing baselines and the token-load cost: token-load-scorer, softmax-picker,
session-affinity, kv-affinity, round-robin, power-of-two, least-request."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from epp.load.token_load import EndpointLoad
from epp.plugins.kv_affinity import KVAffinityFilter, KVAffinityParameters
from epp.plugins.load_balancing import LeastRequestScorer, PowerOfTwoFilter, PowerOfTwoParameters
from epp.plugins.pickers import PickerParameters, RoundRobinPicker, SoftmaxPicker, SoftmaxPickerParameters
from epp.plugins.session_affinity import HashRing, SessionAffinityFilter, SessionAffinityParameters
from epp.plugins.token_load_scorer import TokenLoadScorer, TokenLoadScorerParameters
from epp.scheduling.cycle_data import PREFIX_MATCH, TOKEN_LOAD, PrefixMatch
from epp.scheduling.framework import CycleState, NoParameters, PluginContext, ScoredEndpoint
from tests.epp.factories import FakeClock, endpoint_state, make_request


def seeded(seed: int = 7) -> PluginContext:
    return PluginContext(clock=FakeClock(), rng=random.Random(seed))


def names(endpoints) -> list[str]:
    return [e.name for e in endpoints]


def test_token_load_cost_by_hand(context: PluginContext) -> None:
    scorer = TokenLoadScorer(
        "t", TokenLoadScorerParameters(prefillLoadScale=2.0, blockSizeTokens=16), context
    )
    endpoints = [endpoint_state(i) for i in range(3)]
    state = CycleState()
    state.put(
        TOKEN_LOAD,
        {"e0": EndpointLoad(3, 160, 320, 0, 480), "e2": EndpointLoad(1, 32, 64, 0, 96)},  # e1: nothing booked
    )
    state.put(PREFIX_MATCH, PrefixMatch(6, {"e0": 4, "e2": 6}, block_size_tokens=16))
    request = make_request(list(range(100)))
    # Active KV tokens count whether requests are prefilling or decoding (Dynamo's active blocks):
    # e0: 2·(160 + 100 − 64)/16 + 480/16 = 54.5;  e1: 2·100/16 = 12.5
    # e2: 2·(32 + 100 − 96)/16 + 96/16 = 10.5
    assert scorer.costs(request, endpoints, state) == [54.5, 12.5, 10.5]
    assert scorer.score(request, endpoints, state) == pytest.approx([0.0, 42 / 44, 1.0])
    assert scorer.score(request, endpoints, CycleState()) == [1.0, 1.0, 1.0]  # no data: no preference


def test_synced_replicas_add_a_margin_per_live_peer_to_moving_a_conversation(context: PluginContext) -> None:
    scorer = TokenLoadScorer("t", TokenLoadScorerParameters(replicaMoveMargin=0.5), context)
    endpoints = [endpoint_state(i) for i in range(3)]
    request = make_request(list(range(160)))  # 10 blocks
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 6, "e1": 2}, block_size_tokens=16))
    alone = scorer.costs(request, endpoints, state)
    assert alone == [4.0, 8.0, 10.0]  # (160 − cached)/16, nothing booked
    peers = [3]
    scorer.join_replicas(lambda: peers[0])
    # e0 holds 6 of the 10 blocks: moving off it costs 0.5 · 3 peers · 10 blocks more.
    assert scorer.costs(request, endpoints, state) == [4.0, 23.0, 25.0]
    peers[0] = 0  # no live peer: scored as one EPP alone
    assert scorer.costs(request, endpoints, state) == alone
    peers[0] = 3
    short = CycleState()  # the longest match holds under half the prompt: no conversation to keep
    short.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 4}, block_size_tokens=16))
    assert scorer.costs(request, endpoints, short) == [6.0, 10.0, 10.0]
    off = TokenLoadScorer("t", TokenLoadScorerParameters(), context)  # replicaMoveMargin 0
    off.join_replicas(lambda: 3)
    assert off.costs(request, endpoints, state) == alone


def scored(*scores: float) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(endpoint_state(i), s) for i, s in enumerate(scores)]


def test_softmax_picker_at_temperature_zero_is_argmax_with_random_ties() -> None:
    picker = SoftmaxPicker("s", SoftmaxPickerParameters(), seeded())
    request = make_request([])
    assert {picker.pick(request, scored(0.2, 0.9, 0.5))[0].name for _ in range(50)} == {"e1"}
    assert {picker.pick(request, scored(0.9, 0.9, 0.5))[0].name for _ in range(200)} == {"e0", "e1"}


def test_softmax_picker_samples_dynamos_distribution() -> None:
    temperature = 0.5
    picker = SoftmaxPicker(
        "s", SoftmaxPickerParameters(temperature=temperature, maxNumOfEndpoints=3), seeded(3)
    )
    scores = (1.0, 0.75, 0.0)  # normalised costs 0, 0.25, 1
    weights = [math.exp(-(1.0 - s) / temperature) for s in scores]
    expected = [w / sum(weights) for w in weights]
    n = 10_000
    picks = [picker.pick(make_request([]), scored(*scores)) for _ in range(n)]
    firsts = Counter(p[0].name for p in picks)
    for i, p in enumerate(expected):
        assert firsts[f"e{i}"] / n == pytest.approx(p, abs=0.02)
    assert all(sorted(names(p)) == ["e0", "e1", "e2"] for p in picks)  # fallbacks: every endpoint once
    # The normalisation makes the distribution independent of the scores' scale and offset.
    shifted = Counter(picker.pick(make_request([]), scored(12.0, 11.5, 10.0))[0].name for _ in range(n))
    for i, p in enumerate(expected):
        assert shifted[f"e{i}"] / n == pytest.approx(p, abs=0.02)


def test_round_robin_cycles_in_name_order() -> None:
    picker = RoundRobinPicker("rr", PickerParameters(), seeded())
    candidates = [ScoredEndpoint(endpoint_state(i), 0.0) for i in (2, 0, 1)]
    assert [picker.pick(make_request([]), candidates)[0].name for _ in range(6)] == ["e0", "e1", "e2"] * 2


def test_least_request_prefers_fewest_in_flight(context: PluginContext) -> None:
    endpoints = [endpoint_state(i) for i in range(3)]
    for e, n in zip(endpoints, (4, 0, 2), strict=True):
        e.in_flight = n
    scorer = LeastRequestScorer("l", NoParameters(), context)
    assert scorer.score(make_request([]), endpoints, CycleState()) == [0.0, 1.0, 0.5]


@pytest.mark.parametrize("load", ["requests", "tokens"])
def test_power_of_two_keeps_the_less_loaded_of_two_random_candidates(load: str) -> None:
    endpoints = [endpoint_state(i) for i in range(3)]
    state = CycleState()
    if load == "requests":
        for e, n in zip(endpoints, (0, 5, 10), strict=True):
            e.in_flight = n
    else:
        state.put(TOKEN_LOAD, {"e1": EndpointLoad(1, 300, 200, 0), "e2": EndpointLoad(1, 0, 5000, 0)})
    p2c = PowerOfTwoFilter("p", PowerOfTwoParameters(load=load), seeded())
    n = 3000
    kept = Counter(names(p2c.filter(make_request([]), endpoints, state))[0] for _ in range(n))
    assert kept["e2"] == 0  # the most loaded never wins a pair
    assert kept["e0"] / n == pytest.approx(2 / 3, abs=0.04)  # e0 wins every pair it is sampled in
    assert names(p2c.filter(make_request([]), endpoints[:1], state)) == ["e0"]


def test_kv_affinity_keeps_the_longest_overlap_whatever_the_load(context: PluginContext) -> None:
    endpoints = [endpoint_state(0, waiting=100), endpoint_state(1), endpoint_state(2, waiting=100)]
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(10, {"e0": 8, "e1": 2, "e2": 8}))
    pure = KVAffinityFilter("k", KVAffinityParameters(), context)
    assert names(pure.filter(make_request([]), endpoints, state)) == ["e0", "e2"]
    ray = KVAffinityFilter("k", KVAffinityParameters(minMatchRatio=0.9), context)
    assert names(ray.filter(make_request([]), endpoints, state)) == ["e0", "e1", "e2"]
    none = CycleState()
    none.put(PREFIX_MATCH, PrefixMatch(10, {}))
    assert len(pure.filter(make_request([]), endpoints, none)) == 3
    assert len(pure.filter(make_request([]), endpoints, CycleState())) == 3


def session_request(key: str | None, header: str = "x-session-id"):
    request = make_request([])
    request.headers = {header: key} if key is not None else {}
    return request


def affinity(**params) -> SessionAffinityFilter:
    return SessionAffinityFilter("s", SessionAffinityParameters(**params), seeded())


def test_session_affinity_is_sticky_and_lets_keyless_requests_through() -> None:
    endpoints = [endpoint_state(i) for i in range(4)]
    f = affinity()
    homes = {names(f.filter(session_request(f"s{k}"), endpoints, CycleState()))[0] for k in range(40)}
    assert homes == {"e0", "e1", "e2", "e3"}
    assert all(
        names(f.filter(session_request("s7"), endpoints, CycleState()))
        == names(f.filter(session_request("s7"), list(reversed(endpoints)), CycleState()))
        for _ in range(3)
    )
    assert len(f.filter(session_request(None), endpoints, CycleState())) == 4
    custom = affinity(headerName="X-Conversation")
    assert len(custom.filter(session_request("c1", "x-conversation"), endpoints, CycleState())) == 1


def test_session_affinity_walks_the_ring_past_saturated_homes() -> None:
    f = affinity(maxWaitingRequests=10, maxKvCacheUsage=0.9, maxTokensInFlight=1000)
    ring = HashRing([f"e{i}" for i in range(4)], 128)
    order = list(ring.successors("user-42"))
    assert sorted(order) == ["e0", "e1", "e2", "e3"]
    home, second = (int(n[1:]) for n in order[:2])
    endpoints = [endpoint_state(i) for i in range(4)]
    request = session_request("user-42")
    assert names(f.filter(request, endpoints, CycleState())) == [order[0]]
    endpoints[home] = endpoint_state(home, waiting=10)
    assert names(f.filter(request, endpoints, CycleState())) == [order[1]]
    endpoints[second] = endpoint_state(second, kv=0.95)
    state = CycleState()
    state.put(TOKEN_LOAD, {order[2]: EndpointLoad(2, 600, 400, 0)})
    assert names(f.filter(request, endpoints, state)) == [order[3]]
    # Gone: a removed home's sessions go to the next endpoint on the ring.
    assert names(f.filter(request, [e for e in endpoints if e.name != order[0]], state)) == [order[3]]
    # Everything saturated: stay home.
    saturated = [endpoint_state(i, waiting=50) for i in range(4)]
    assert names(f.filter(request, saturated, CycleState())) == [order[0]]


def homes(ring: HashRing, keys: list[str]) -> dict[str, str]:
    return {k: next(ring.successors(k)) for k in keys}


@pytest.mark.parametrize("n", [4, 8, 16])
def test_session_homes_move_about_one_in_n_when_a_replica_comes_or_goes(n: int) -> None:
    rng = random.Random(n)
    keys = [f"{rng.getrandbits(64):x}" for _ in range(4000)]
    endpoints = [f"replica-{i}" for i in range(n)]
    before = homes(HashRing(endpoints, 128), keys)
    load = Counter(before.values())
    assert max(load.values()) / min(load.values()) < 1.6  # 128 virtual nodes spread keys evenly

    removed = homes(HashRing(endpoints[1:], 128), keys)
    moved = [k for k in keys if removed[k] != before[k]]
    assert all(before[k] == "replica-0" for k in moved)  # only the removed replica's keys move
    assert len(moved) / len(keys) == pytest.approx(1 / n, rel=0.3)

    added = homes(HashRing([*endpoints, "replica-new"], 128), keys)
    moved = [k for k in keys if added[k] != before[k]]
    assert all(added[k] == "replica-new" for k in moved)  # and only onto the new replica
    assert len(moved) / len(keys) == pytest.approx(1 / (n + 1), rel=0.3)
