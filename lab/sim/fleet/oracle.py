"""``oracle``: a clairvoyant router that reads the true state of every engine, the limit to aim at.

It knows what no real router can: every request's true output length, every engine's exact
prefix cache, queue, batch and KV blocks, and the engine's own step-time model. For each
candidate it estimates, from that state and the cost model, the request's own end-to-end time
there (the step in flight, the prefill queued ahead plus its own uncached prefill in token-budget
chunks beside the decoding batch, then its decode at the batch's step time, plus any wait for KV
blocks or a batch slot, until requests whose true remaining length is shortest free them), and
the delay it inflicts on the requests already there or still in the server's front end (their
steps lengthen for as long as they overlap it, and much more during its prefill). It picks the
smallest sum (ties: the emptiest replica). It is greedy (it does not foresee later arrivals), so
it is a strong bound rather than an optimum.
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.engine import Engine, EngineRequest
from sim.engine.cost_model import chunk_context_tokens
from sim.fleet.replica import Replica
from sim.fleet.routers import Router, RoutingCall


def cached_blocks(engine: Engine, digests: Sequence[bytes], num_tokens: int) -> int:
    """Leading prompt blocks in the engine's prefix cache (at most all but the last token's)."""
    is_cached = engine.kv_cache.is_cached
    limit = min(len(digests), (num_tokens - 1) // engine.config.block_size)
    for index in range(limit):
        if not is_cached(digests[index]):
            return index
    return limit


class OracleRouter(Router):
    name = "oracle"

    def route(self, call: RoutingCall, replicas: Sequence[Replica], now: float) -> Replica:
        return min(
            replicas,
            key=lambda r: (self.cost(r, call, now), r.outstanding(), r.index),
        )

    def cost(self, replica: Replica, call: RoutingCall, now: float) -> float:
        """Seconds: the request's own estimated end-to-end time there, plus the delay it adds to others."""
        engine = replica.engine
        config = engine.config
        step_time = engine.cost_model.step_time
        block_size = config.block_size
        prompt = call.request.input_tokens
        output = call.output_tokens
        hit_tokens = cached_blocks(engine, call.block_digests, prompt) * block_size

        decode_n = decode_context = queued_prefill = 0
        remaining: list[tuple[int, int]] = []  # (true output tokens left, blocks held)
        for request in engine.running:
            left = request.max_output_tokens - len(request.output_token_ids)
            remaining.append((left, len(request.blocks)))
            if request.num_computed_tokens >= request.num_prompt_tokens:
                decode_n += 1
                decode_context += request.num_tokens
            else:
                queued_prefill += request.num_tokens - request.num_computed_tokens
        reserved = 0
        waiting = [*engine.waiting, *replica.arriving.values()]
        for request in waiting:
            queued_prefill += request.num_tokens - _hit_tokens(engine, request)
            reserved += -(-(request.num_tokens + request.max_output_tokens) // block_size)

        usable = engine.kv_cache.num_usable_blocks
        usage = engine.kv_usage
        wait = max(0.0, replica.step.end_time - now) if replica.step is not None else 0.0
        chunk = max(1, config.max_num_batched_tokens - decode_n)
        # The prefill queued ahead, then this request's own uncached prompt, beside the decodes.
        ahead = 0.0
        for start in range(0, queued_prefill, chunk):
            tokens = min(chunk, queued_prefill - start)
            ahead += step_time(tokens, tokens * tokens // 2, decode_n, decode_context, usage)
        own = 0.0
        own_steps = 0
        for computed in range(hit_tokens, prompt, chunk):
            tokens = min(chunk, prompt - computed)
            own += step_time(tokens, chunk_context_tokens(tokens, computed), decode_n, decode_context, usage)
            own_steps += 1
        blocks_needed = -(-(prompt + output) // block_size) - hit_tokens // block_size
        usage_after = min(1.0, usage + blocks_needed / usable)
        context_after = decode_context + prompt + output // 2
        tpot = step_time(0, 0, decode_n + 1, context_after, usage_after)
        before = step_time(0, 0, decode_n, decode_context, usage) if decode_n else 0.0

        # Waiting for KV blocks or a batch slot: until the shortest requests there finish.
        shortage = blocks_needed + reserved - engine.kv_cache.num_free_blocks
        full = len(engine.running) + len(waiting) >= config.max_num_seqs
        slot_wait = 0.0
        if shortage > 0 or full:
            slots_needed = len(waiting) + 1 if full else 0
            finished = sorted(remaining)
            freed = 0
            slot_wait = (finished[-1][0] if finished else 0) * tpot
            for count, (left, blocks) in enumerate(finished, start=1):
                freed += blocks
                if freed >= shortage and count >= slots_needed:
                    slot_wait = left * tpot
                    break
        own_e2e = wait + slot_wait + ahead + own + (output - 1) * tpot
        # Delay inflicted on every request already there (decoding now, or by the time this one
        # prefills): their steps lengthen while they overlap it, and each of its prefill steps
        # costs them more than a plain decode step.
        others = len(engine.running) + len(waiting)
        plain = step_time(0, 0, others, decode_context, usage) if others else 0.0
        harm = sum(min(left, output) for left, _ in remaining) * max(0.0, tpot - before)
        harm += others * max(0.0, own - own_steps * plain)
        return own_e2e + harm


def _hit_tokens(engine: Engine, request: EngineRequest) -> int:
    if request.num_cached_tokens >= 0:  # preempted after its first admission
        return 0
    return cached_blocks(engine, request.block_hashes, request.num_prompt_tokens) * engine.config.block_size
