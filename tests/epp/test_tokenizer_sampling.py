"""``--tokenize-every N``: the model's tokenizer on one prompt in N, the others' counts estimated
at the bytes per token those measure, ids that keep shared prefixes shared at any ratio, an EPP
that refuses to pair it with matching against the engines' own ids, and synced replicas that
route on one ratio."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from epp.app import EppApp
from epp.kvcache.approximate_index import prefix_block_hashes
from epp.kvcache.block_hash import chain_hashes
from epp.load.peer_totals import PeerTotals
from epp.scheduling.config import ConfigError
from epp.settings import EppSettings
from epp.sync.messages import decode, heartbeat_bytes_per_token
from epp.sync.state import ReplicaSyncState, SyncTargets
from epp.tokenizer.estimated import MAX_BYTES_PER_TOKEN, estimated_ids
from epp.tokenizer.model import ModelTokenizer
from epp.tokenizer.sampling import SAMPLE_CHARS, CalibrationCollector, CountCalibration, SampledTokenizer
from sim.models import TINY_MODEL_DIR
from sim.processes import free_port
from tests.epp.extproc_harness import Harness
from tests.epp.factories import FakeClock, local_epp_settings
from tests.support import prose


class CountingModel:
    """The tiny model's tokenizer, counting the prompts it tokenizes."""

    def __init__(self) -> None:
        self.model = ModelTokenizer(TINY_MODEL_DIR)
        self.encoded = 0
        self.longest = 0

    exact = True
    cache = None
    max_chars_per_token = 1

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        self.encoded += 1
        self.longest = max(self.longest, len(text))
        return self.model.encode(text, max_chars)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.model.render_chat(messages, add_generation_prompt)


@given(data=st.binary(), ratio=st.floats(1, MAX_BYTES_PER_TOKEN))
def test_one_id_per_ratio_of_bytes_begun(data: bytes, ratio: float) -> None:
    assert len(estimated_ids(data, ratio)) == math.ceil(len(data) / ratio)


@given(prefix=st.binary(min_size=1), a=st.binary(), b=st.binary(), ratio=st.floats(1, MAX_BYTES_PER_TOKEN))
def test_at_any_ratio_a_shared_prefix_shares_its_whole_runs(
    prefix: bytes, a: bytes, b: bytes, ratio: float
) -> None:
    ids_a, ids_b = estimated_ids(prefix + a, ratio), estimated_ids(prefix + b, ratio)
    shared = math.floor(len(prefix) / ratio)  # runs that end inside the prefix
    assert ids_a[:shared] == ids_b[:shared]
    assert all(0 <= i < 1 << 32 for i in ids_a)  # as a vocabulary's: the prefix index packs them so
    assert chain_hashes(ids_a, 2)[: shared // 2] == chain_hashes(ids_b, 2)[: shared // 2]
    approximate_a, approximate_b = prefix_block_hashes(ids_a, 2), prefix_block_hashes(ids_b, 2)
    assert approximate_a[: shared // 2] == approximate_b[: shared // 2]


def test_runs_that_differ_in_a_byte_differ() -> None:
    assert estimated_ids(b"abcdefgh", 2.5) != estimated_ids(b"abcdefgx", 2.5)
    assert estimated_ids(b"abcdefgh", 7.5) != estimated_ids(b"abcdefgx", 7.5)
    assert estimated_ids(b"ab", 1.0) != estimated_ids(b"ba", 1.0)


@pytest.mark.parametrize("ratio", [0.5, MAX_BYTES_PER_TOKEN + 1])
def test_a_ratio_outside_the_runs_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="bytes per token"):
        estimated_ids(b"text", ratio)


def test_the_ratio_moves_after_a_window_only_when_it_is_off_by_more_than_the_tolerance() -> None:
    calibration = CountCalibration(window=4, tolerance=0.1)
    for _ in range(3):
        calibration.observe(430, 100)  # 4.3 bytes a token: within 10% of 4
    assert calibration.last_error is None  # no window yet
    calibration.observe(430, 100)
    assert (calibration.bytes_per_token, calibration.changes) == (4, 0)
    assert calibration.last_error == pytest.approx((100 - 108) / -100)
    for _ in range(4):
        calibration.observe(250, 100)
    assert (calibration.bytes_per_token, calibration.changes) == (2.5, 1)
    assert calibration.last_error == pytest.approx(0.37)  # estimated at 4 bytes: 63 tokens
    for _ in range(4):
        calibration.observe(10_000, 1)  # past the longest run: clamped
    assert calibration.bytes_per_token == MAX_BYTES_PER_TOKEN


def test_one_prompt_in_n_is_tokenized_and_the_counts_come_to_the_models_scale() -> None:
    model = CountingModel()
    sampled = SampledTokenizer(model, every=4, calibration=CountCalibration(window=16))
    rng = random.Random(7)
    prompts = [prose(rng, rng.randint(50, 400)) for _ in range(400)]

    def mean_error(texts: list[str]) -> float:
        errors = [
            abs(len(sampled.encode(t)) - len(model.model.encode(t))) / len(model.model.encode(t))
            for t in texts
        ]
        return sum(errors) / len(errors)

    before = mean_error(prompts[:40])  # the fixed estimate: 4 bytes a token
    for text in prompts[40:]:
        sampled.encode(text)
    assert sampled.sampled == model.encoded == 400 // 4
    after = mean_error(prompts[:40])
    # The tiny model's small vocabulary makes ~2.9 bytes a token of this prose, not 4.
    assert before > 0.2 and after < 0.05, (before, after)
    assert 2.6 < sampled.calibration.bytes_per_token < 3.2
    assert sampled.calibration.changes == 1  # one move, then within the tolerance
    assert sampled.calibration.last_error is not None and sampled.calibration.last_error < 0.05


def test_a_long_prompt_is_sampled_over_its_tail_only() -> None:
    model = CountingModel()
    sampled = SampledTokenizer(model, every=2, calibration=CountCalibration(window=1))
    long = prose(random.Random(3), 20_000)
    assert len(long) > 4 * SAMPLE_CHARS
    ids = [sampled.encode(long) for _ in range(2)]
    assert model.encoded == 1 and model.longest == SAMPLE_CHARS
    tail = long[-SAMPLE_CHARS:]
    assert sampled.calibration.bytes_per_token == pytest.approx(len(tail) / len(model.model.encode(tail)))
    assert len(ids[1]) == math.ceil(len(long) / 4)  # the sampled prompt itself went out at the old ratio


def test_chat_is_rendered_by_the_models_template() -> None:
    sampled = SampledTokenizer(ModelTokenizer(TINY_MODEL_DIR), every=8)
    messages = [{"role": "user", "content": "Hello there"}]
    assert sampled.render_chat(messages) == ModelTokenizer(TINY_MODEL_DIR).render_chat(messages)


def test_the_calibration_is_exported_while_the_tokenizer_samples() -> None:
    registry = CollectorRegistry()
    current: list[Any] = [ModelTokenizer(TINY_MODEL_DIR)]
    registry.register(CalibrationCollector("pool", lambda: current[0]))
    assert registry.get_sample_value("llm_epp_tokenizer_bytes_per_token", {"name": "pool"}) is None
    current[0] = SampledTokenizer(
        ModelTokenizer(TINY_MODEL_DIR), every=2, calibration=CountCalibration(window=2)
    )
    for n in range(4):
        current[0].encode(prose(random.Random(n), 100))
    value = registry.get_sample_value
    assert value("llm_epp_tokenizer_sampled_prompts_total", {"name": "pool"}) == 2
    assert value("llm_epp_tokenizer_ratio_changes_total", {"name": "pool"}) == 1
    assert 2 < value("llm_epp_tokenizer_bytes_per_token", {"name": "pool"}) < 3.5
    assert value("llm_epp_tokenizer_estimate_error", {"name": "pool"}) > 0.2  # the window at 4 bytes


async def test_prompts_over_the_context_go_to_the_engine_to_refuse() -> None:
    """The EPP refuses only on exact counts: an estimate must not refuse what the engine takes."""
    sampled = SampledTokenizer(ModelTokenizer(TINY_MODEL_DIR), every=2)
    harness = Harness(tokenizer=sampled, default_max_model_len=8)
    prompt = "many words here " * 20
    record = harness.director.open({})
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    async for _ in record.schedule("/v1/completions", {}, body):
        pass
    assert record.request is not None and record.request.prompt_token_ids == estimated_ids(prompt.encode())


def test_an_epp_samples_its_models_tokenizer_when_told(tmp_path: Path) -> None:
    app = EppApp(local_epp_settings(tmp_path, tokenize_every=8))
    tokenizer = app.director.tokenizer
    assert isinstance(tokenizer, SampledTokenizer) and tokenizer.every == 8 and not tokenizer.exact


def test_an_epp_refuses_to_sample_with_a_config_that_matches_the_engines_ids(tmp_path: Path) -> None:
    settings = local_epp_settings(tmp_path, config="precise-prefix", tokenize_every=8)
    with pytest.raises(ConfigError, match=r"needs the engine's.*--tokenize-every 1"):
        EppApp(settings)


def test_sampling_needs_a_models_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenize-every samples a model's tokenizer"):
        fields = local_epp_settings(tmp_path).model_dump()
        EppSettings(**{**fields, "tokenizer_source": "estimate", "tokenizer_dir": None, "tokenize_every": 8})


# ---- synced replicas: one ratio ------------------------------------------------------------


def test_a_peers_ratio_is_followed_and_the_windows_do_not_move_it_until_it_goes() -> None:
    peer: list[float | None] = [2.5]
    sampled = SampledTokenizer(
        ModelTokenizer(TINY_MODEL_DIR),
        every=2,
        calibration=CountCalibration(window=4),
        agreed=lambda: peer[0],
    )
    text = prose(random.Random(5), 300)
    assert len(sampled.encode(text)) == math.ceil(len(text) / 2.5)
    assert sampled.calibration.announced == 2.5  # taken from the peer: announced as ours
    for _ in range(16):  # windows measure ~2.9 bytes a token: more than 10% off, but not ours to move
        sampled.encode(text)
    assert sampled.calibration.bytes_per_token == 2.5 and sampled.calibration.last_error is not None
    peer[0] = None  # the peer left: our own windows move it again
    for _ in range(8):
        sampled.encode(text)
    assert 2.6 < sampled.calibration.bytes_per_token < 3.2


def test_nothing_is_announced_before_a_window_ends() -> None:
    sampled = SampledTokenizer(
        ModelTokenizer(TINY_MODEL_DIR), every=2, calibration=CountCalibration(window=2)
    )
    sampled.encode("one prompt")
    assert sampled.calibration.announced is None
    for _ in range(3):
        sampled.encode("one prompt")
    assert sampled.calibration.announced == sampled.calibration.bytes_per_token


def _replica(name: str, ratio: float | None) -> ReplicaSyncState:
    state = ReplicaSyncState(name, SyncTargets(token_load=PeerTotals()), clock=FakeClock(), incarnation=1)
    state.bytes_per_token = lambda: ratio
    return state


def test_replicas_route_on_the_ratio_of_the_first_by_name_that_announces_one() -> None:
    a, b, c = _replica("a", None), _replica("b", 2.6), _replica("c", 2.4)
    for src in (a, b, c):
        for dst in (a, b, c):
            if dst is not src:
                dst.receive(src.heartbeat())
    # a announces none (not calibrated): b is first among those that do.
    assert (a.agreed_bytes_per_token(), b.agreed_bytes_per_token(), c.agreed_bytes_per_token()) == (
        2.6,
        None,  # b leads: its own ratio
        2.6,
    )
    assert heartbeat_bytes_per_token(decode(b.heartbeat()).body) == 2.6
    assert decode(a.heartbeat()).body == [0]  # nothing to announce: the body older replicas send
    assert heartbeat_bytes_per_token([0, "x"]) is None and heartbeat_bytes_per_token([0, 50.0]) is None


def test_a_synced_epp_announces_its_calibrated_ratio_and_follows_its_peers(tmp_path: Path) -> None:
    settings = local_epp_settings(
        tmp_path, tokenize_every=2, sync_nats_url=[f"nats://127.0.0.1:{free_port()}"], replica_id="b"
    )
    app = EppApp(settings)
    state, tokenizer = app.sync.state, app.director.tokenizer  # type: ignore[union-attr]
    assert isinstance(tokenizer, SampledTokenizer)
    assert decode(state.heartbeat()).body == [int(state.capabilities)]  # not calibrated yet
    state.receive(_replica("a", 2.5).heartbeat())
    text = prose(random.Random(9), 200)
    assert len(tokenizer.encode(text)) == math.ceil(len(text) / 2.5)
    assert heartbeat_bytes_per_token(decode(state.heartbeat()).body) == 2.5
