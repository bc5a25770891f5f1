"""``max-score-picker``'s ``replicaTieBreak``: replicas that hear live peers break ties by a
rendezvous hash of the prompt, the same in every replica; without peers the picker's own RNG
breaks them exactly as before."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

from epp.plugins.pickers import MaxScorePicker, MaxScorePickerParameters, prompt_fingerprint, rendezvous_rank
from epp.scheduling.framework import PluginContext, ScoredEndpoint
from tests.epp.factories import endpoint_state, make_request


def _picker(seed: int, *, peers: bool | None, tie_break: str = "prompt-hash") -> MaxScorePicker:
    picker = MaxScorePicker(
        "m",
        MaxScorePickerParameters(replicaTieBreak=tie_break),
        PluginContext(clock=lambda: 0.0, rng=random.Random(seed)),
    )
    if peers is not None:
        picker.join_replicas(lambda: peers)
    return picker


def _scored(scores: list[float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(endpoint_state(i), s) for i, s in enumerate(scores)]


def _prompt(i: int) -> list[int]:
    return [i * 7919 + t for t in range(50 + i % 300)]


def test_without_live_peers_ties_are_broken_by_the_pickers_rng_as_before() -> None:
    reference = random.Random(3)
    for peers in (None, False):
        reference.seed(3)
        picker = _picker(3, peers=peers)
        for i in range(50):
            scores = [1.0, 1.0, 0.5, 1.0]
            keys = [(s, reference.random()) for s in scores]
            expected = sorted(range(4), key=keys.__getitem__, reverse=True)[:3]
            ranked = picker.pick(make_request(_prompt(i)), _scored(scores))
            assert [e.name for e in ranked] == [f"e{j}" for j in expected]


def test_replicas_with_peers_agree_on_identical_prompts_and_spread_different_ones() -> None:
    first, second = _picker(1, peers=True), _picker(2, peers=True)
    winners: Counter[str] = Counter()
    for i in range(200):
        request = make_request(_prompt(i))
        pick = first.pick(request, _scored([1.0] * 4))[0].name
        assert second.pick(request, _scored([1.0] * 4))[0].name == pick
        assert first.pick(request, list(reversed(_scored([1.0] * 4))))[0].name == pick  # order-free
        winners[pick] += 1
    assert set(winners) == {"e0", "e1", "e2", "e3"}
    assert all(30 <= n <= 70 for n in winners.values())  # 50 expected, sd 6


def test_hashed_ties_only_choose_among_the_best_scores() -> None:
    picker = _picker(1, peers=True)
    for i in range(40):
        ranked = picker.pick(make_request(_prompt(i)), _scored([0.2, 0.9, 0.9, 0.4]))
        assert {ranked[0].name, ranked[1].name} == {"e1", "e2"}
        assert ranked[2].name == "e3"


def test_random_tie_break_leaves_replicas_independent() -> None:
    first, second = _picker(1, peers=True, tie_break="random"), _picker(2, peers=True, tie_break="random")
    picks = [
        (first.pick(r, _scored([1.0] * 4))[0].name, second.pick(r, _scored([1.0] * 4))[0].name)
        for r in (make_request(_prompt(i)) for i in range(40))
    ]
    assert any(a != b for a, b in picks)


def test_fingerprint_and_rank_tell_prompts_apart_and_are_the_same_in_another_process() -> None:
    prompt = list(range(1000))
    assert prompt_fingerprint(prompt) == prompt_fingerprint(list(prompt))
    assert prompt_fingerprint(prompt) != prompt_fingerprint(prompt[:-1])
    assert prompt_fingerprint(prompt) != prompt_fingerprint([*prompt[:-1], 5])
    assert prompt_fingerprint([]) != prompt_fingerprint([0])
    mine = prompt_fingerprint(prompt)
    assert rendezvous_rank(mine, "e0") != rendezvous_rank(mine, "e1")
    code = (
        "from epp.plugins.pickers import prompt_fingerprint as f, rendezvous_rank as r; "
        "print(f(list(range(1000))).hex(), r(f(list(range(1000))), 'e0'))"
    )
    other = subprocess.run(  # another hash seed: a str hash() would differ there
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.split() == [mine.hex(), repr(rendezvous_rank(mine, "e0"))]


def test_requests_without_a_prompt_spread_even_with_peers() -> None:
    picker = _picker(5, peers=True)
    winners = Counter(picker.pick(make_request([]), _scored([1.0] * 4))[0].name for _ in range(80))
    assert set(winners) == {"e0", "e1", "e2", "e3"}
