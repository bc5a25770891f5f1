"""A step-level model of vLLM v1's engine: scheduler, KV cache and a timed forward pass.

The caller owns time. Each step is two calls::

    step = engine.schedule(now)            # pick the batch, allocate KV, price the step
    ...                                    # let step.duration seconds pass (real or virtual)
    outputs = engine.finish_step(step, now)

``schedule`` follows vLLM v1 with FCFS policy and chunked prefill:

1. Running requests, in admission order, each get the tokens it still lacks (a decode token or
   the next prefill chunk) while the step's token budget lasts. When KV blocks run out, the
   most recently admitted running request is preempted (recompute mode: its blocks are freed,
   its progress is forgotten, it goes back to the front of the waiting queue) until the
   allocation fits or the request itself was the one preempted.
2. Unless step 1 preempted anyone, waiting requests are admitted in order while budget and
   ``max_num_seqs`` allow: a prefix-cache lookup gives the tokens already computed, the rest
   (or a chunk of it) is scheduled, provided blocks for the whole sequence are free.

A step's duration is the cost model's price for its batch, plus the intake time of the requests
added since the previous step (``cost_model.IntakeTerms``).

``finish_step`` advances every scheduled request; one whose tokens are all computed samples one
new token, and finishes when it has its output length.

There is no I/O, no clock and no global random state, so the same calls give the same results.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.kvcache.block_hash import chain_hashes
from sim.engine.config import EngineConfig
from sim.engine.cost_model import StepCostModel, chunk_context_tokens
from sim.engine.kv_cache import KVCacheManager
from sim.engine.request import EngineRequest, RequestStatus


class RequestRejectedError(ValueError):
    """The engine can never serve this request (too long, empty, duplicate id)."""


@dataclass(slots=True)
class ScheduledStep:
    """One batch: which requests compute how many tokens, and how long it takes."""

    start_time: float
    duration: float
    requests: list[EngineRequest]
    num_scheduled_tokens: list[int]
    """Tokens computed for ``requests[i]`` in this step."""
    num_prefill_tokens: int
    num_decode_seqs: int
    preempted: list[EngineRequest]

    @property
    def end_time(self) -> float:
        return self.start_time + self.duration


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in a step: a new token, and possibly its finish."""

    request: EngineRequest
    new_token_ids: list[int]
    finish_reason: str | None
    """``"length"`` or ``"stop"`` when the request finished in this step, else None."""
    is_first_token: bool
    inter_token_latency: float | None
    """Seconds since the request's previous token; None for the first."""


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counts, in vLLM's Prometheus meanings."""

    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache at first admission (re-admissions after a
    preemption are not counted)."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token (cached ones included)."""
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    scheduled_tokens: int = 0
    """Tokens actually computed by all steps (prefill chunks and decodes)."""
    busy_seconds: float = 0.0
    """Modelled duration of all steps (the simulator's own; vLLM has no such count)."""


class Engine:
    """One simulated vLLM engine.

    ``output_vocab`` lists the token ids generated tokens are drawn from; it must not contain
    EOS or other special tokens.
    """

    def __init__(self, config: EngineConfig, cost_model: StepCostModel, output_vocab: Sequence[int]) -> None:
        if not output_vocab:
            raise ValueError("output_vocab is empty")
        self.config = config
        self.cost_model = cost_model
        self.kv_cache = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            record_events=config.enable_kv_events,
        )
        self.counters = EngineCounters()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._output_vocab = output_vocab
        self._unfinished: dict[str, EngineRequest] = {}
        self._arrived: list[EngineRequest] = []
        """Added since the last ``schedule``: not yet in the scheduler's queue."""
        self._intake_s = 0.0
        """Engine time the requests added since the last step took in (``IntakeTerms``)."""
        self._step_in_flight = False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running, preempted ones included (as vLLM counts them)."""
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_request(self, request_id: str) -> EngineRequest | None:
        """The unfinished request with this id, if any."""
        return self._unfinished.get(request_id)

    def add_request(self, request: EngineRequest, now: float) -> None:
        """Queue a new request; raises RequestRejectedError if it can never be served."""
        self._validate(request)
        if request.arrival_time is None:
            request.arrival_time = now
        if self.config.enable_prefix_caching and not request.block_hashes:
            request.block_hashes = chain_hashes(
                request.all_token_ids, self.config.block_size, cache_salt=request.cache_salt
            )
        self.waiting.append(request)
        self._unfinished[request.request_id] = request
        self._arrived.append(request)
        self._intake_s += self.cost_model.intake.time(request.num_prompt_tokens)

    def abort_request(self, request_id: str, now: float) -> EngineRequest | None:
        """Drop an unfinished request and free its blocks; None if it is not (or no longer) here.

        Safe while a step is in flight: ``finish_step`` skips requests aborted meanwhile.
        """
        request = self._unfinished.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv_cache.free(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.finish_time = now
        return request

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (nothing done) while any request holds blocks."""
        return self.kv_cache.reset_prefix_cache()

    def drain_kv_events(self) -> list[dict[str, Any]]:
        """vLLM-shaped KV events since the last call (empty unless ``enable_kv_events``)."""
        return self.kv_cache.drain_events()

    def schedule(self, now: float) -> ScheduledStep | None:
        """Pick the next batch and price it; None when there is nothing to run."""
        if self._step_in_flight:
            raise RuntimeError("schedule() called before finish_step() of the previous step")
        self._take_in_arrivals(now)
        budget = self.config.max_num_batched_tokens
        requests: list[EngineRequest] = []
        num_tokens: list[int] = []
        preempted: list[EngineRequest] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, count, preempted):
                break
            requests.append(request)
            num_tokens.append(count)
            budget -= count
            index += 1

        if not preempted:
            budget = self._admit_waiting(budget, requests, num_tokens, now)

        if not requests:
            return None
        return self._price(now, requests, num_tokens, preempted)

    def finish_step(self, step: ScheduledStep, now: float) -> list[RequestOutput]:
        """Apply a scheduled step's results at time ``now``; returns one output per new token."""
        self._step_in_flight = False
        block_size = self.config.block_size if self.config.enable_prefix_caching else None
        counters = self.counters
        vocab = self._output_vocab
        vocab_size = len(vocab)
        outputs: list[RequestOutput] = []
        finished_any = False
        for request, count in zip(step.requests, step.num_scheduled_tokens, strict=True):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += count
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk, no token yet
            is_first = request.first_token_time is None
            if is_first:
                self._record_first_token(request, now)
                itl = None
            else:
                itl = now - request.last_token_time
            request.last_token_time = now
            # Indexing by random() is several times cheaper than Random.choice.
            token_id = vocab[int(request.rng.random() * vocab_size)]
            request.append_output_token(token_id, block_size)
            counters.generation_tokens += 1
            finished = self._check_stop(request, now)
            finished_any |= finished
            outputs.append(
                RequestOutput(
                    request=request,
                    new_token_ids=[token_id],
                    finish_reason=request.finish_reason if finished else None,
                    is_first_token=is_first,
                    inter_token_latency=itl,
                )
            )
        if finished_any:
            self.running = [request for request in self.running if not request.is_finished]
        return outputs

    def fast_forward_decode(self, now: float, horizon: float) -> tuple[float, int]:
        """Run at once the pure-decode steps that start at ``now``, end by ``horizon`` and finish nobody.

        The result is exactly what that many ``schedule(t)`` / ``finish_step(step, step.end_time)``
        pairs would leave (tokens, blocks taken in the same order, prefix-cache registrations,
        counters, ``last_token_time``), without the per-step outputs and inter-token latencies:
        the fleet simulator uses it to skip the step loop while a batch only decodes.

        It runs nothing, returning ``(now, 0)``, unless no step is in flight, every running request
        is decoding, the batch fits the token budget, nothing waits to be admitted (or the batch
        is at ``max_num_seqs``), no request's intake is pending and KV events are off. It stops
        before a step that would finish a request, need more blocks than are free, or end after
        ``horizon``. Returns the end time
        of the last step run and how many ran.
        """
        config = self.config
        running = self.running
        n = len(running)
        if (
            self._step_in_flight
            or n == 0
            or n > config.max_num_batched_tokens
            or self.kv_cache.record_events
            or self._intake_s
            or (self.waiting and n < config.max_num_seqs)
        ):
            return now, 0
        block_size = config.block_size
        groups: list[list[EngineRequest]] = [[] for _ in range(block_size)]
        max_steps = None
        context = 0
        for request in running:
            computed = request.num_computed_tokens
            if len(request.all_token_ids) - computed != 1 or computed < request.num_prompt_tokens:
                return now, 0
            limit = request.max_output_tokens
            if request.stop_after_tokens is not None:
                limit = min(limit, request.stop_after_tokens)
            steps_left = limit - len(request.output_token_ids) - 1
            max_steps = steps_left if max_steps is None else min(max_steps, steps_left)
            # The first step whose token needs a block beyond those held; then every block_size steps.
            first_alloc = len(request.blocks) * block_size - computed + 1
            if not 1 <= first_alloc <= block_size:
                return now, 0
            groups[first_alloc % block_size].append(request)
            context += computed + 1
        if max_steps is None or max_steps < 1:
            return now, 0

        needs = [len(group) for group in groups]
        usable = self.kv_cache.num_usable_blocks
        free = self.kv_cache.num_free_blocks
        step_time = self.cost_model.step_time
        end, steps = now, 0
        for step in range(1, max_steps + 1):
            need = needs[step % block_size]
            if need > free:
                break
            duration = step_time(0, 0, n, context, 1.0 - (free - need) / usable)
            if end + duration > horizon:
                break
            free -= need
            end += duration
            context += n
            steps = step
        if steps == 0:
            return now, 0

        self._take_in_arrivals(now)
        kv_cache = self.kv_cache
        for step in range(1, steps + 1):
            for request in groups[step % block_size]:
                kv_cache.append_block(request)
        vocab = self._output_vocab
        vocab_size = len(vocab)
        hash_size = block_size if config.enable_prefix_caching else None
        for request in running:
            rng = request.rng
            append = request.append_output_token
            for _ in range(steps):
                append(vocab[int(rng.random() * vocab_size)], hash_size)
            request.num_computed_tokens += steps
            kv_cache.cache_full_blocks(request, request.num_computed_tokens // block_size)
            request.last_token_time = end
        counters = self.counters
        counters.num_steps += steps
        counters.scheduled_tokens += n * steps
        counters.busy_seconds += end - now
        counters.generation_tokens += n * steps
        return end, steps

    def _take_in_arrivals(self, now: float) -> None:
        # vLLM's engine core takes new requests off its input queue between steps, and its
        # scheduler stamps them queued then: a request's queue time leaves out the step it arrived
        # during (that wait counts in its time to first token only).
        for request in self._arrived:
            request.queued_time = now
        self._arrived.clear()

    def _validate(self, request: EngineRequest) -> None:
        config = self.config
        if request.request_id in self._unfinished:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in the engine")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise RequestRejectedError(f"request {request.request_id!r} was already run")
        if request.num_prompt_tokens == 0:
            raise RequestRejectedError("the prompt is empty")
        if request.max_output_tokens < 1:
            raise RequestRejectedError(
                f"max_output_tokens must be at least 1, got {request.max_output_tokens}"
            )
        total = request.num_prompt_tokens + request.max_output_tokens
        if total > config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_output_tokens "
                f"({request.max_output_tokens}) exceeds max_model_len ({config.max_model_len})"
            )
        # The last generated token is never fed back, so it needs no KV slot.
        blocks_needed = -(-(total - 1) // config.block_size)
        if blocks_needed > config.num_usable_blocks:
            raise RequestRejectedError(
                f"the request needs {blocks_needed} KV blocks ({total - 1} tokens) but the KV cache "
                f"holds only {config.num_usable_blocks} ({config.kv_capacity_tokens} tokens)"
            )
        if (
            request.block_hashes
            and len(request.block_hashes) != request.num_prompt_tokens // config.block_size
        ):
            raise RequestRejectedError(
                f"prompt_block_hashes has {len(request.block_hashes)} digests; a prompt of "
                f"{request.num_prompt_tokens} tokens has {request.num_prompt_tokens // config.block_size} "
                f"full blocks of {config.block_size}"
            )

    def _allocate_or_preempt(
        self, request: EngineRequest, count: int, preempted: list[EngineRequest]
    ) -> bool:
        """Allocate blocks for a running request, preempting from the back until it fits.

        False if the request itself had to be preempted.
        """
        while not self.kv_cache.allocate_slots(request, count):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: EngineRequest) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(
        self, budget: int, requests: list[EngineRequest], num_tokens: list[int], now: float
    ) -> int:
        """Admit waiting requests in order while they fit; returns the budget left."""
        block_size = self.config.block_size
        kv_cache = self.kv_cache
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = kv_cache.get_computed_blocks(request)
            num_hit_tokens = len(hits) * block_size
            count = min(request.num_tokens - num_hit_tokens, budget)
            if not kv_cache.allocate_slots(request, count, hits, reserve_full_sequence=True):
                break
            self.waiting.popleft()
            self._record_admission(request, num_hit_tokens, now)
            self.running.append(request)
            requests.append(request)
            num_tokens.append(count)
            budget -= count
        return budget

    def _record_admission(self, request: EngineRequest, num_hit_tokens: int, now: float) -> None:
        if request.num_preemptions == 0 and self.config.enable_prefix_caching:
            self.counters.prefix_cache_queries += request.num_tokens
            self.counters.prefix_cache_hits += num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING

    def _price(
        self,
        now: float,
        requests: list[EngineRequest],
        num_tokens: list[int],
        preempted: list[EngineRequest],
    ) -> ScheduledStep:
        num_prefill_tokens = 0
        prefill_context = 0
        num_decode_seqs = 0
        decode_context = 0
        for request, count in zip(requests, num_tokens, strict=True):
            if count == 1 and request.num_computed_tokens >= request.num_prompt_tokens:
                num_decode_seqs += 1
                decode_context += request.num_computed_tokens + 1
            else:
                num_prefill_tokens += count
                prefill_context += chunk_context_tokens(count, request.num_computed_tokens)
        duration = self._intake_s + self.cost_model.step_time(
            num_prefill_tokens, prefill_context, num_decode_seqs, decode_context, self.kv_usage
        )
        self._intake_s = 0.0
        self.counters.num_steps += 1
        self.counters.scheduled_tokens += num_prefill_tokens + num_decode_seqs
        self.counters.busy_seconds += duration
        self._step_in_flight = True
        return ScheduledStep(
            start_time=now,
            duration=duration,
            requests=requests,
            num_scheduled_tokens=num_tokens,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_seqs=num_decode_seqs,
            preempted=preempted,
        )

    def _record_first_token(self, request: EngineRequest, now: float) -> None:
        request.first_token_time = now
        self.counters.prompt_tokens += request.num_prompt_tokens
        self.counters.prompt_tokens_cached += request.num_cached_tokens
        registered = min(request.num_cached_blocks * self.config.block_size, request.num_prompt_tokens)
        request.num_cache_creation_tokens = max(0, registered - request.num_cached_tokens)

    def _check_stop(self, request: EngineRequest, now: float) -> bool:
        if request.num_output_tokens >= request.max_output_tokens:
            status = RequestStatus.FINISHED_LENGTH
        elif request.stop_after_tokens is not None and request.num_output_tokens >= request.stop_after_tokens:
            status = RequestStatus.FINISHED_STOPPED
        else:
            return False
        request.status = status
        request.finish_time = now
        self.kv_cache.free(request)
        del self._unfinished[request.request_id]
        return True
