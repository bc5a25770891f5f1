"""The scheduler and step loop: batching, chunked prefill, limits, preemption, caching, aborts."""

from __future__ import annotations

import dataclasses

import pytest

from epp.kvcache.block_hash import chain_hashes
from sim.engine import (
    DecodeTerms,
    Engine,
    EngineRequest,
    IntakeTerms,
    PrefillTerms,
    RequestRejectedError,
    RequestStatus,
    StepCostModel,
)
from sim.engine.cost_model import chunk_context_tokens

from .conftest import TEST_COST, TEST_VOCAB, EngineRun, make_engine, prompt


def test_generates_exactly_max_output_tokens() -> None:
    run = EngineRun(make_engine())
    lengths = {"a": 1, "b": 7, "c": 20}
    run.add(*(EngineRequest(rid, prompt(10 + i), n) for i, (rid, n) in enumerate(lengths.items())))
    run.run()
    for request_id, length in lengths.items():
        outputs = run.outputs[request_id]
        assert len(run.tokens(request_id)) == length
        assert [o.finish_reason for o in outputs] == [None] * (length - 1) + ["length"]
        assert outputs[0].is_first_token and not any(o.is_first_token for o in outputs[1:])
        assert all(token in TEST_VOCAB for token in run.tokens(request_id))
    assert run.engine.kv_usage == 0.0
    assert run.engine.counters.generation_tokens == sum(lengths.values())


def test_stop_after_tokens_models_eos() -> None:
    run = EngineRun(make_engine())
    run.add(EngineRequest("a", prompt(5), 10, stop_after_tokens=3))
    run.run()
    assert len(run.tokens("a")) == 3
    assert run.outputs["a"][-1].finish_reason == "stop"


def test_new_requests_join_the_running_batch() -> None:
    run = EngineRun(make_engine())
    run.add(EngineRequest("long", prompt(8), 30))
    for _ in range(3):
        run.step()
    run.add(EngineRequest("short", prompt(8, start=2000), 2))
    step = run.step()
    assert [r.request_id for r in step.requests] == ["long", "short"]
    assert step.num_scheduled_tokens == [1, 8]
    assert (step.num_decode_seqs, step.num_prefill_tokens) == (1, 8)
    run.run()
    short_done = run.outputs["short"][-1]
    assert short_done.finish_reason == "length"
    assert short_done.request.finish_time < run.outputs["long"][-1].request.finish_time


def test_a_request_is_queued_at_the_first_step_after_it_arrived_as_vllm_stamps_it() -> None:
    engine = make_engine(max_num_seqs=2)
    engine.add_request(EngineRequest("first", prompt(16), 3), 0.0)
    step = engine.schedule(0.0)
    assert step is not None
    mid_step = step.end_time / 2
    engine.add_request(EngineRequest("during", prompt(8, start=1000), 2), mid_step)
    engine.add_request(EngineRequest("behind", prompt(16, start=2000), 2), mid_step)
    engine.finish_step(step, step.end_time)
    second = engine.schedule(step.end_time)
    assert second is not None
    during, behind = engine.get_request("during"), engine.get_request("behind")
    assert during is not None and behind is not None
    # Arrived mid-step, taken in at the next step: no queue time, and scheduled at once.
    assert during.arrival_time == mid_step
    assert during.queued_time == during.first_scheduled_time == step.end_time
    # Taken in at the same boundary, but the batch is full: it queues from there.
    assert behind.queued_time == step.end_time
    assert behind.first_scheduled_time is None


def test_chunked_prefill_stays_within_the_token_budget() -> None:
    run = EngineRun(make_engine(max_num_batched_tokens=64))
    run.add(EngineRequest("a", prompt(10), 20))
    run.step()  # a's prefill
    run.add(EngineRequest("b", prompt(150, start=3000), 2))
    prefill_steps = []
    while run.engine.get_request("b").first_token_time is None:
        prefill_steps.append(run.step())
    assert [s.num_scheduled_tokens for s in prefill_steps] == [[1, 63], [1, 63], [1, 24]]
    run.run()
    assert all(sum(step.num_scheduled_tokens) <= 64 for step in run.steps)
    assert len(run.tokens("b")) == 2


def test_max_num_seqs_caps_the_batch() -> None:
    run = EngineRun(make_engine(max_num_seqs=2))
    run.add(*(EngineRequest(f"r{i}", prompt(6, start=100 * i + 1000), 5) for i in range(5)))
    while run.engine.has_unfinished_requests():
        step = run.step()
        assert len(step.requests) <= 2
        assert run.engine.num_running <= 2
        assert run.engine.num_running + run.engine.num_waiting == len(
            [i for i in range(5) if run.engine.get_request(f"r{i}")]
        )
    assert all(len(run.tokens(f"r{i}")) == 5 for i in range(5))


def test_preempts_the_newest_request_when_kv_runs_out_and_all_finish() -> None:
    # 8 usable blocks of 4 tokens; each request grows to 8 + 15 = 23 tokens (6 blocks).
    run = EngineRun(make_engine(num_gpu_blocks=9, max_num_seqs=2))
    run.add(EngineRequest("old", prompt(8), 16), EngineRequest("new", prompt(8, start=2000), 16))
    run.step()
    run.add(EngineRequest("late", prompt(4, start=3000), 2))
    while not run.engine.counters.num_preemptions:
        step = run.step()
    assert [r.request_id for r in step.preempted] == ["new"]
    assert [r.request_id for r in step.requests] == ["old"]  # no admissions in a step that preempts
    assert [r.request_id for r in run.engine.waiting] == ["new", "late"]
    preempted = run.engine.get_request("new")
    assert preempted.status is RequestStatus.PREEMPTED
    assert preempted.num_computed_tokens == 0 and preempted.blocks == []
    run.run()
    assert all(len(run.tokens(rid)) == n for rid, n in [("old", 16), ("new", 16), ("late", 2)])
    assert preempted.num_preemptions >= 1
    assert run.engine.kv_usage == 0.0


def test_preempted_request_recomputes_prompt_and_output() -> None:
    run = EngineRun(make_engine(num_gpu_blocks=9))
    run.add(EngineRequest("old", prompt(8), 16), EngineRequest("new", prompt(8, start=2000), 16))
    while not run.engine.counters.num_preemptions:
        run.step()
    victim = run.engine.get_request("new")
    generated = victim.num_output_tokens
    assert generated > 0
    step = run.step()
    while victim not in step.requests:
        step = run.step()
    # Back in, it computes its prompt and generated tokens again (less whole cached blocks), then
    # goes on generating where it stopped.
    scheduled = step.num_scheduled_tokens[step.requests.index(victim)]
    assert (8 + generated - scheduled) % 4 == 0
    assert victim.num_computed_tokens == 8 + generated
    assert victim.num_output_tokens == generated + 1
    run.run()
    assert len(run.tokens("new")) == 16


def test_cached_tokens_follow_the_vllm_rule() -> None:
    engine = make_engine(block_size=32, num_gpu_blocks=200, max_model_len=4096, max_num_batched_tokens=8192)
    run = EngineRun(engine)
    for length, expected in [(132, 128), (1257, 1248)]:
        tokens = prompt(length, start=5000 + length)
        run.add(EngineRequest(f"first-{length}", tokens, 2))
        run.run()
        run.add(EngineRequest(f"again-{length}", tokens, 2))
        run.run()
        assert run.outputs[f"first-{length}"][0].request.num_cached_tokens == 0
        assert run.outputs[f"again-{length}"][0].request.num_cached_tokens == expected
    counters = engine.counters
    assert counters.prefix_cache_queries == 2 * (132 + 1257)
    assert counters.prefix_cache_hits == 128 + 1248
    assert counters.prompt_tokens_cached == 128 + 1248


def test_identical_prompts_admitted_together_share_blocks() -> None:
    # Blocks are registered when scheduled, so the second request hits the first's blocks at once.
    run = EngineRun(make_engine())
    tokens = prompt(17)
    run.add(EngineRequest("a", tokens, 3), EngineRequest("b", tokens, 3))
    step = run.step()
    assert step.num_scheduled_tokens == [17, 1]
    assert run.engine.get_request("b").num_cached_tokens == 16


def test_blocks_filled_by_generated_tokens_are_cached() -> None:
    run = EngineRun(make_engine(block_size=16, num_gpu_blocks=64))
    run.add(EngineRequest("a", prompt(40), 30))
    run.run()
    conversation = run.outputs["a"][-1].request.all_token_ids  # 70 tokens, 64 of them computed
    run.add(EngineRequest("b", conversation, 1))
    run.run()
    assert run.outputs["b"][0].request.num_cached_tokens == 64


def test_created_cache_tokens_count_new_full_prompt_blocks() -> None:
    run = EngineRun(make_engine())
    run.add(EngineRequest("a", prompt(10), 1))
    run.run()
    run.add(EngineRequest("b", prompt(18), 1))
    run.run()
    first = run.outputs["a"][0].request
    second = run.outputs["b"][0].request
    assert (first.num_cached_tokens, first.num_cache_creation_tokens) == (0, 8)
    assert (second.num_cached_tokens, second.num_cache_creation_tokens) == (8, 8)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    engine = make_engine()
    run = EngineRun(engine)
    run.add(EngineRequest("running", prompt(20), 50), EngineRequest("in-step", prompt(9, start=400), 50))
    run.step()
    run.add(EngineRequest("waiting", prompt(8, start=800), 5))
    assert engine.abort_request("waiting", run.now).status is RequestStatus.FINISHED_ABORTED
    assert engine.abort_request("running", run.now).finish_reason == "abort"
    step = engine.schedule(run.now)
    assert engine.abort_request("in-step", run.now) is not None  # while its step is in flight
    assert engine.finish_step(step, step.end_time) == []
    assert engine.abort_request("in-step", run.now) is None
    assert not engine.has_unfinished_requests()
    assert engine.num_running == engine.num_waiting == 0
    assert engine.kv_usage == 0.0
    assert engine.schedule(step.end_time) is None


def test_same_inputs_give_same_outputs_and_timings() -> None:
    def scenario(seed: int | None) -> tuple[list[list[int]], list[float]]:
        run = EngineRun(make_engine(num_gpu_blocks=20))
        for i in range(6):
            run.add(EngineRequest(f"r{i}", prompt(5 + 7 * i, start=50 * i), 12, seed=seed))
        run.run()
        return [run.tokens(f"r{i}") for i in range(6)], [s.duration for s in run.steps]

    assert scenario(None) == scenario(None)
    assert scenario(7) == scenario(7)
    assert scenario(7)[0] != scenario(8)[0]


def test_a_new_requests_intake_lengthens_the_next_step_only() -> None:
    cost = dataclasses.replace(TEST_COST, intake=IntakeTerms(base=0.5, per_prompt_token=0.01))
    plain, taking_in = EngineRun(make_engine()), EngineRun(Engine(make_engine().config, cost, TEST_VOCAB))
    for run in (plain, taking_in):
        run.add(EngineRequest("a", prompt(30), 4))
        run.step()
        run.add(EngineRequest("b", prompt(10, start=500), 2), EngineRequest("c", prompt(20, start=900), 2))
        run.run()
    durations = [(p.duration, t.duration) for p, t in zip(plain.steps, taking_in.steps, strict=True)]
    # "a" is taken in before the first step, "b" and "c" before the second; later steps pay nothing.
    assert durations[0][1] - durations[0][0] == pytest.approx(0.0008)
    assert durations[1][1] - durations[1][0] == pytest.approx(0.0013)
    assert all(t == p for p, t in durations[2:])
    busier = taking_in.engine.counters.busy_seconds - plain.engine.counters.busy_seconds
    assert busier == pytest.approx(0.0021)


def test_step_duration_comes_from_the_cost_model() -> None:
    run = EngineRun(make_engine())
    run.add(EngineRequest("a", prompt(30), 3))
    prefill = run.step()
    decode = run.step()
    assert prefill.duration == pytest.approx(TEST_COST.step_time(30, 30 * 31 // 2, 0, 0, run.engine.kv_usage))
    assert prefill.duration == pytest.approx((1.0 + 0.01 * 30) / 1000)
    assert decode.duration == pytest.approx(1.0 / 1000)
    assert decode.end_time == pytest.approx(prefill.end_time + decode.duration)


def test_the_engine_counts_the_modelled_time_of_all_its_steps() -> None:
    run = EngineRun(make_engine(num_gpu_blocks=20))
    for i in range(4):
        run.add(EngineRequest(f"r{i}", prompt(5 + 9 * i, start=50 * i), 7))
    run.run()
    assert run.engine.counters.busy_seconds == pytest.approx(sum(s.duration for s in run.steps), rel=1e-12)
    assert run.engine.counters.busy_seconds > 0


def test_prefill_attention_counts_each_chunk_against_its_context() -> None:
    # Priced per attended pair only, so a step's duration in µs is its attention work.
    cost = StepCostModel(PrefillTerms(per_context_token=0.001), DecodeTerms(min=1.0))
    run = EngineRun(Engine(make_engine(max_num_batched_tokens=64).config, cost, TEST_VOCAB))
    run.add(EngineRequest("a", prompt(10), 2), EngineRequest("b", prompt(100, start=3000), 2))
    first, second = run.step(), run.step()
    assert first.num_scheduled_tokens == [10, 54]
    # Two prompts attend within themselves only, not to each other.
    assert first.duration * 1e6 == pytest.approx(chunk_context_tokens(10, 0) + chunk_context_tokens(54, 0))
    # b's second chunk attends to its first; a's decode is priced by the decode terms (floor 1 ms).
    assert second.num_scheduled_tokens == [1, 46]
    assert second.duration * 1e6 == pytest.approx(1000 + chunk_context_tokens(46, 54))


def test_rejects_requests_it_can_never_serve() -> None:
    engine = make_engine(max_model_len=100, num_gpu_blocks=11)  # 10 usable blocks = 40 tokens
    cases = {
        "empty": EngineRequest("empty", [], 5),
        "no output": EngineRequest("no output", prompt(5), 0),
        "too long": EngineRequest("too long", prompt(90), 20),
        "too big for KV": EngineRequest("too big for KV", prompt(30), 20),
        "wrong hashes": EngineRequest("wrong hashes", prompt(9), 2, prompt_block_hashes=[b"x"]),
    }
    for request in cases.values():
        with pytest.raises(RequestRejectedError):
            engine.add_request(request, 0.0)
    engine.add_request(EngineRequest("ok", prompt(30), 11), 0.0)  # 40 tokens with KV: fits exactly
    with pytest.raises(RequestRejectedError, match="already"):
        engine.add_request(EngineRequest("ok", prompt(3), 1), 0.0)
    assert engine.num_waiting == 1


def test_precomputed_prompt_hashes_are_used() -> None:
    run = EngineRun(make_engine())
    tokens = prompt(12)
    run.add(EngineRequest("a", tokens, 1, prompt_block_hashes=chain_hashes(tokens, 4)))
    run.run()
    run.add(EngineRequest("b", [*tokens, 1], 1))
    run.run()
    assert run.outputs["b"][0].request.num_cached_tokens == 12


def test_reset_prefix_cache_waits_for_idle_engine() -> None:
    run = EngineRun(make_engine())
    run.add(EngineRequest("a", prompt(12), 3))
    run.step()
    assert not run.engine.reset_prefix_cache()
    run.run()
    run.engine.drain_kv_events()
    assert run.engine.reset_prefix_cache()
    assert run.engine.drain_kv_events() == [{"type": "AllBlocksCleared"}]


def test_schedule_needs_the_previous_step_finished() -> None:
    engine = make_engine()
    engine.add_request(EngineRequest("a", prompt(4), 2), 0.0)
    engine.schedule(0.0)
    with pytest.raises(RuntimeError):
        engine.schedule(0.0)


def test_kv_events_follow_the_recorded_vllm_sequence() -> None:
    # Recorded on vLLM 0.32 (kv_events_sample.txt): a 132-token prompt, 40 output tokens, blocks of
    # 32 -> one BlockStored of 4 prompt blocks, then one of the block completed by generated tokens.
    engine = make_engine(block_size=32, num_gpu_blocks=512, max_model_len=2048, max_num_batched_tokens=8192)
    run = EngineRun(engine)
    run.add(EngineRequest("a", prompt(132), 40))
    run.run()
    first, second = engine.drain_kv_events()
    request = run.outputs["a"][0].request
    assert (first["type"], len(first["block_hashes"]), first["parent_block_hash"]) == ("BlockStored", 4, None)
    assert len(first["token_ids"]) == 128 and first["extra_keys"] == [None] * 4
    assert second["parent_block_hash"] == first["block_hashes"][-1]
    assert second["token_ids"] == request.all_token_ids[128:160]
