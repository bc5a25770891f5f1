"""Prometheus metrics of one simulated engine, with vLLM 0.32's names, labels and buckets.

Counted as vLLM counts them: prompt tokens when a request's first token comes out (cached ones
included); prefix-cache queries and hits in tokens at first admission; ``iteration_tokens_total``
once per step that produced tokens, as the prompt tokens computed for requests that produced their
first token plus the tokens generated. Aborted requests do not count as successes (vLLM does not
record client aborts either). Gauges are read from the engine when scraped. Two metrics are the
simulator's own, not vLLM's: ``llm_epp_sim_step_lag_seconds``, how late each engine step started
(``EngineDriver``), so that a replica starved of CPU is seen as such; and
``llm_epp_sim_engine_busy_seconds_total``, the modelled duration of all steps, to compare with
the CPU time of vLLM's engine-core thread over the same work.

The router scrapes every 50 ms, and rendering a registry costs about 5 µs a line, so the
metrics live in two registries: gauges and counters (~60 lines, ~0.25 ms) are rendered on every
scrape; the histograms (~350 lines, ~2 ms) are re-rendered at most every
``histogram_refresh_s`` and only when they changed, so they may lag by that much.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from operator import attrgetter

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sim.engine import Engine, EngineConfig, EngineCounters, RequestOutput
from sim.host_cpu import HostCpu, host_cpu

# Bucket boundaries as vLLM 0.32 publishes them (vllm/v1/metrics/buckets.py).
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
STEP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Seconds; the simulator's own ``llm_epp_sim_step_lag_seconds`` (vLLM has no such metric)."""
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(value)
        scale *= 10


class EngineMetricsExporter:
    """Metrics of one engine in registries of their own; ``record_step`` after every step.

    ``cpu`` is the CPU whose vLLM CPU build the cache config labels follow (default: this
    machine's, where the conformance suite runs real vLLM beside the simulator).
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        histogram_refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        cpu: HostCpu | None = None,
    ) -> None:
        self.live_registry = CollectorRegistry()
        self.histogram_registry = CollectorRegistry()
        self._histogram_refresh_s = histogram_refresh_s
        self._clock = clock
        self._histogram_text = b""
        self._histograms_dirty = True
        self._histograms_rendered_at = -math.inf
        self._engine = engine
        self._labels = {"model_name": model_name, "engine": "0"}
        self._define_gauges(engine)
        self._define_counters()
        self._define_histograms(engine.config)
        self._define_cache_config_info(engine.config, cpu or host_cpu())

    def render(self) -> bytes:
        """The text exposition format of all metrics."""
        now = self._clock()
        if self._histograms_dirty and now - self._histograms_rendered_at >= self._histogram_refresh_s:
            self._histogram_text = generate_latest(self.histogram_registry)
            self._histograms_dirty = False
            self._histograms_rendered_at = now
        return generate_latest(self.live_registry) + self._histogram_text

    def record_step(self, outputs: list[RequestOutput]) -> None:
        """Account for one finished step and the outputs it produced."""
        self._sync_counters()
        if not outputs:
            return
        self._histograms_dirty = True
        computed_prompt_tokens = 0
        for output in outputs:
            request = output.request
            if output.is_first_token:
                computed_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
                self._ttft.observe(request.first_token_time - request.arrival_time)
            else:
                self._itl.observe(output.inter_token_latency)
            if output.finish_reason is not None:
                self._record_finished(output)
        self._iteration_tokens.observe(computed_prompt_tokens + len(outputs))

    def record_step_lag(self, lag_s: float) -> None:
        """Account for how late a step started (``EngineDriver``'s ``on_step_lag``)."""
        self._histograms_dirty = True
        self._step_lag.observe(lag_s)

    def _record_finished(self, output: RequestOutput) -> None:
        request = output.request
        num_generated = request.num_output_tokens
        decode_time = request.last_token_time - request.first_token_time
        self._success[output.finish_reason].inc()
        self._e2e.observe(request.finish_time - request.arrival_time)
        self._queue_time.observe(request.first_scheduled_time - request.queued_time)
        self._prefill_time.observe(request.first_token_time - request.first_scheduled_time)
        self._decode_time.observe(decode_time)
        self._inference_time.observe(request.last_token_time - request.first_scheduled_time)
        self._tpot.observe(decode_time / (num_generated - 1) if num_generated > 1 else 0.0)
        self._prompt_tokens_hist.observe(request.num_prompt_tokens)
        self._generation_tokens_hist.observe(num_generated)
        self._num_preemptions_hist.observe(request.num_preemptions)
        self._prefill_kv_computed.observe(request.num_prompt_tokens - request.num_cached_tokens)

    def _sync_counters(self) -> None:
        counters = self._engine.counters
        for index, (metric, read) in enumerate(self._mirrored_counters):
            value = read(counters)
            delta = value - self._synced[index]
            if delta:
                metric.inc(delta)
                self._synced[index] = value

    def _define_gauges(self, engine: Engine) -> None:
        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, list(self._labels), registry=self.live_registry)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            **self._labels
        ).set_function(lambda: engine.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            **self._labels
        ).set_function(lambda: engine.num_waiting)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*self._labels, "reason"],
            registry=self.live_registry,
        )
        by_reason.labels(**self._labels, reason="capacity").set_function(lambda: engine.num_waiting)
        by_reason.labels(**self._labels, reason="deferred").set(0)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(
            **self._labels
        ).set_function(lambda: engine.kv_usage)

    def _define_counters(self) -> None:
        def family(name: str, documentation: str, *extra_labels: str) -> Counter:
            return Counter(name, documentation, [*self._labels, *extra_labels], registry=self.live_registry)

        def counter(name: str, documentation: str) -> Counter:
            return family(name, documentation).labels(**self._labels)

        by_source = family("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source")
        computed, cache_hit, _ = (
            by_source.labels(**self._labels, source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        )
        # Each counter mirrors a cumulative engine count; record_step adds what changed.
        self._mirrored_counters: list[tuple[Counter, Callable[[EngineCounters], float]]] = [
            (
                counter(
                    "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
                ),
                attrgetter("prefix_cache_queries"),
            ),
            (
                counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                attrgetter("prefix_cache_hits"),
            ),
            (
                counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                attrgetter("num_preemptions"),
            ),
            (
                counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
                attrgetter("prompt_tokens"),
            ),
            (computed, lambda c: c.prompt_tokens - c.prompt_tokens_cached),
            (cache_hit, attrgetter("prompt_tokens_cached")),
            (
                counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
                attrgetter("prompt_tokens_cached"),
            ),
            (
                counter("vllm:generation_tokens", "Number of generation tokens processed."),
                attrgetter("generation_tokens"),
            ),
            (
                counter("llm_epp_sim_engine_busy_seconds", "Modelled duration of all engine steps."),
                attrgetter("busy_seconds"),
            ),
        ]
        self._synced: list[float] = [0] * len(self._mirrored_counters)
        success = family(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason"
        )
        self._success = {
            reason: success.labels(**self._labels, finished_reason=reason) for reason in FINISH_REASONS
        }

    def _define_histograms(self, config: EngineConfig) -> None:
        def histogram(name: str, documentation: str, buckets: tuple | list) -> Histogram:
            return Histogram(
                name, documentation, list(self._labels), buckets=buckets, registry=self.histogram_registry
            ).labels(**self._labels)

        tokens = request_tokens_buckets(config.max_model_len)
        self._prompt_tokens_hist = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self._generation_tokens_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._num_preemptions_hist = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self._prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self._step_lag = histogram(
            "llm_epp_sim_step_lag_seconds",
            "How late each engine step started: its start minus when it was due (the previous "
            "step's end, or the last submit to an idle engine). Simulator only: shows CPU "
            "starvation of the engine process.",
            STEP_LAG_BUCKETS,
        )

    def _define_cache_config_info(self, config: EngineConfig, cpu: HostCpu) -> None:
        # vLLM publishes its whole CacheConfig as labels. These are vLLM 0.32's names, with this
        # engine's geometry, and elsewhere the values vLLM's CPU build shows on ``cpu`` for a Llama
        # model with default cache settings (so a scraper finds every label it would find on vLLM).
        blocks_per_request = -(-config.max_model_len // config.block_size)
        labels = {
            "_block_size_resolved": "True",
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(config.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.92",
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(config.num_gpu_blocks / blocks_per_request),
            "kv_cache_memory_bytes": "None",
            "kv_cache_size_tokens": str(config.num_gpu_blocks * config.block_size),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": cpu.vllm_mamba_ssm_cache_dtype,
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "True",
        }
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(labels),
            registry=self.live_registry,
        )
        info.labels(**labels).set(1)
