"""The precise prefix index: lookup time, memory, and KV-event ingest rate.

1. **Lookup.** One 100k-token prompt (3,125 blocks of 32) against 64 tracked endpoints, where
   endpoint *i* holds the first (i+1)/64 of the prompt's blocks among a million other blocks:
   the EPP's hashing of the prompt (vLLM's chained SHA-256), the index lookup alone, and the
   whole ``precise-prefix-cache-producer`` step (hashing, precise and fallback lookups).
2. **Memory.** One million distinct blocks spread over 64 endpoints: the table's size and the
   memory Python allocated for it (tracemalloc), against a ``dict`` of ``set``s holding the same.
3. **Ingest.** Batches shaped like vLLM's (three ``BlockStored`` of 4 blocks with their 128
   token ids and one ``BlockRemoved``, per engine step): decoding and applying them in order
   (``decode_batch`` + ``EventStream``), and end to end over ZMQ: the simulator's publisher in
   another process, the EPP's subscriber in this one, until the last block is indexed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from prometheus_client import CollectorRegistry
from rich.progress import Progress

from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.kv_events import KVEventsSubscriber
from epp.datalayer.metrics import KVEventMetrics
from epp.kvcache.block_hash import BlockHasher
from epp.kvcache.events import EventStream, decode_batch
from epp.kvcache.precise_index import PreciseIndex
from epp.plugins.precise_prefix_cache import PrecisePrefixCacheProducer, PrecisePrefixParameters
from epp.scheduling.framework import CycleState, PluginContext
from epp.scheduling.types import ApiKind, Endpoint, EndpointState, EngineMetrics, LLMRequest
from sim.kv_events import KVEventPublisher, KVEventsConfig, encode_batch
from sim.measure.report import machine, markdown_table, write_results

BLOCK_SIZE = 32
NAME = "engine-0"
E2E_TIMEOUT_S = 120.0


@dataclass
class KVIndexBenchSettings:
    prompt_tokens: int = 100_000
    endpoints: int = 64
    background_blocks: int = 1_000_000
    lookup_repeats: int = 30
    memory_blocks: int = 1_000_000
    ingest_batches: int = 20_000
    e2e_batches: int = 20_000
    seed: int = 0


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3),
    }


def _timed(call: Any, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def measure_lookup(settings: KVIndexBenchSettings) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    tokens = [rng.randrange(10, 32_000) for _ in range(settings.prompt_tokens)]
    hasher = BlockHasher()
    chain = hasher.external_chain(tokens, BLOCK_SIZE)
    index = PreciseIndex()
    names = [f"e{i}" for i in range(settings.endpoints)]
    for i, name in enumerate(names):
        index.add_endpoint(name)
        index.store(name, chain[: len(chain) * (i + 1) // len(names)])
    per_endpoint = settings.background_blocks // len(names)
    for name in names:
        index.store(name, [rng.getrandbits(64) for _ in range(per_endpoint)])
    context = PluginContext(clock=time.monotonic, kv_index=index)
    producer = PrecisePrefixCacheProducer("p", PrecisePrefixParameters(), context)
    states = [
        EndpointState(Endpoint(name, "127.0.0.1", 8000 + i), EngineMetrics()) for i, name in enumerate(names)
    ]
    request = LLMRequest("r", "tiny", ApiKind.COMPLETIONS, tokens)
    matched = index.longest_prefix(chain)
    assert matched[names[-1]] == len(chain), "the lookup is wrong"
    repeats = settings.lookup_repeats
    return {
        "prompt_blocks": len(chain),
        "indexed_blocks": len(index),
        "hash_prompt": _ms(_timed(lambda: hasher.external_chain(tokens, BLOCK_SIZE), repeats)),
        "index_lookup": _ms(_timed(lambda: index.longest_prefix(chain), repeats)),
        "producer": _ms(_timed(lambda: producer.produce(request, states, CycleState()), repeats)),
    }


def measure_memory(settings: KVIndexBenchSettings) -> dict[str, Any]:
    rng = random.Random(settings.seed + 1)
    hashes = [rng.getrandbits(64) for _ in range(settings.memory_blocks)]
    names = [f"e{i}" for i in range(settings.endpoints)]
    step = len(hashes) // len(names)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PreciseIndex()
    for i, name in enumerate(names):
        index.add_endpoint(name)
        index.store(name, hashes[i * step : (i + 1) * step])
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    blocks = len(index)
    del index
    base = tracemalloc.get_traced_memory()[0]
    baseline: dict[int, set[str]] = {}
    for i, name in enumerate(names):
        for h in hashes[i * step : (i + 1) * step]:
            baseline.setdefault(h, set()).add(name)
    # The keys are shared with ``hashes``: count them as the dict would hold its own.
    baseline_bytes = tracemalloc.get_traced_memory()[0] - base + 32 * len(baseline)
    tracemalloc.stop()
    return {
        "blocks": blocks,
        "index_mib": round(index_bytes / 2**20, 1),
        "bytes_per_block": round(index_bytes / blocks, 1),
        "dict_of_sets_mib": round(baseline_bytes / 2**20, 1),
    }


def _vllm_like_events(count: int, seed: int) -> list[list[dict[str, Any]]]:
    """``count`` engine steps: each stores three chained 4-block runs and evicts the first."""
    rng = random.Random(seed)
    steps, parent = [], None
    for _ in range(count):
        events: list[dict[str, Any]] = []
        for _ in range(3):
            hashes = [rng.getrandbits(64) for _ in range(4)]
            events.append({
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": [rng.randrange(32_000) for _ in range(4 * BLOCK_SIZE)],
                "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None] * 4, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
            })  # fmt: skip
            parent = hashes[-1]
        events.append(
            {
                "type": "BlockRemoved",
                "block_hashes": events[0]["block_hashes"],
                "medium": "GPU",
                "group_idx": 0,
            }
        )
        steps.append(events)
    return steps


EVENTS_PER_STEP, BLOCKS_KEPT_PER_STEP = 4, 8


def measure_ingest(settings: KVIndexBenchSettings) -> dict[str, Any]:
    steps = _vllm_like_events(settings.ingest_batches, settings.seed + 2)
    batches = [(n.to_bytes(8, "big"), encode_batch(time.time(), events)) for n, events in enumerate(steps)]
    index = PreciseIndex()
    index.add_endpoint(NAME)
    stream = EventStream(index, NAME)
    start = time.perf_counter()
    for seq, payload in batches:
        stream.accept(decode_batch(seq, payload))
    elapsed = time.perf_counter() - start
    assert index.blocks_held(NAME) == BLOCKS_KEPT_PER_STEP * len(batches)
    return {
        "batches": len(batches),
        "events_per_s": round(EVENTS_PER_STEP * len(batches) / elapsed),
        "blocks_per_s": round(16 * len(batches) / elapsed),
    }


def _publish(endpoint: str, count: int, seed: int, go: Any, done: Any) -> None:
    """Child process: the simulator's publisher, priming until the subscriber is live, then
    ``count`` vLLM-like batches as fast as it can send them, kept until the subscriber is done."""
    steps = _vllm_like_events(count, seed)
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    try:
        while not go.wait(0.05):
            publisher.publish([{"type": "AllBlocksCleared"}])
        for events in steps:
            publisher.publish(events)
        done.wait(E2E_TIMEOUT_S)
    finally:
        publisher.close()


async def _subscribe(endpoint: str, expected_blocks: int, go: Any, done: Any) -> float:
    store, index, registry = EndpointStore(), PreciseIndex(), CollectorRegistry()
    subscriber = KVEventsSubscriber(store, index, time.monotonic, KVEventMetrics(registry))
    store.replace([Endpoint(NAME, "127.0.0.1", 1, kv_events_endpoint=endpoint)])
    subscriber.start()
    primed = {"model_server_pod": NAME, "type": "AllBlocksCleared"}
    try:
        while not registry.get_sample_value("llm_epp_kv_events_received_total", primed):
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        go.set()
        while index.blocks_held(NAME) < expected_blocks:
            if time.perf_counter() - start > E2E_TIMEOUT_S:
                raise RuntimeError(f"{index.blocks_held(NAME)} of {expected_blocks} blocks indexed")
            await asyncio.sleep(0.001)
        return time.perf_counter() - start
    finally:
        done.set()
        await subscriber.close()


def measure_end_to_end(settings: KVIndexBenchSettings) -> dict[str, Any]:
    count = settings.e2e_batches
    with tempfile.TemporaryDirectory(prefix="kvbench-") as scratch:
        endpoint = f"ipc://{scratch}/events.sock"
        spawn = multiprocessing.get_context("spawn")
        go, done = spawn.Event(), spawn.Event()
        child = spawn.Process(target=_publish, args=(endpoint, count, settings.seed + 3, go, done))
        child.start()
        try:
            elapsed = asyncio.run(_subscribe(endpoint, BLOCKS_KEPT_PER_STEP * count, go, done))
        finally:
            child.join(30)
    return {
        "batches": count,
        "events_per_s": round(EVENTS_PER_STEP * count / elapsed),
        "seconds": round(elapsed, 2),
    }


def _plot(data: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lookup = data["lookup"]
    parts = ["hash_prompt", "index_lookup", "producer"]
    left.bar(parts, [lookup[p]["median_ms"] for p in parts], color=["#888", "#4a7", "#47a"])
    left.set_ylabel("ms (median)")
    left.set_title(
        f"{data['settings']['prompt_tokens']:,}-token prompt, {data['settings']['endpoints']} endpoints"
    )
    rates = {"decode + apply": data["ingest"]["events_per_s"], "over ZMQ": data["end_to_end"]["events_per_s"]}
    right.bar(list(rates), list(rates.values()), color=["#4a7", "#47a"])
    right.set_ylabel("events/s")
    right.set_title("KV-event ingest")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(data: dict[str, Any]) -> str:
    lookup, memory, ingest, e2e = data["lookup"], data["memory"], data["ingest"], data["end_to_end"]
    s, host = data["settings"], data["machine"]
    steps = [
        ("hash the prompt (vLLM SHA-256 chain)", "hash_prompt"),
        ("index lookup (longest prefix, all endpoints)", "index_lookup"),
        ("precise-prefix-cache-producer (all of it)", "producer"),
    ]
    dict_per_block = round(memory["dict_of_sets_mib"] * 2**20 / memory["blocks"], 1)
    sections = [
        "# Precise prefix index (KV events)",
        f"Machine: {host['cpus']} CPUs, Python {host['python']}, {host['date']}.",
        f"## Lookup: {s['prompt_tokens']:,}-token prompt ({lookup['prompt_blocks']:,} blocks), "
        f"{s['endpoints']} endpoints, {lookup['indexed_blocks']:,} blocks indexed",
        markdown_table(
            ["step", "median ms", "p90 ms"],
            [[name, lookup[key]["median_ms"], lookup[key]["p90_ms"]] for name, key in steps],
        ),
        f"## Memory: {memory['blocks']:,} blocks over {s['endpoints']} endpoints",
        markdown_table(
            ["structure", "MiB", "bytes/block"],
            [
                ["PreciseIndex (numpy open addressing)", memory["index_mib"], memory["bytes_per_block"]],
                ["dict of sets (for comparison)", memory["dict_of_sets_mib"], dict_per_block],
            ],
        ),
        "## Ingest (vLLM-shaped batches of 4 events, 16 blocks)",
        markdown_table(
            ["path", "events/s", "batches"],
            [
                ["decode + apply in order", f"{ingest['events_per_s']:,}", ingest["batches"]],
                ["end to end over ZMQ (publisher process)", f"{e2e['events_per_s']:,}", e2e["batches"]],
            ],
        ),
        "![kv index](kv-index.png)",
    ]
    return "\n\n".join(sections)


def run(out_dir: Path, settings: KVIndexBenchSettings | None = None) -> dict[str, Any]:
    settings = settings or KVIndexBenchSettings()
    with Progress() as progress:
        task = progress.add_task("kv-index", total=4)
        lookup = measure_lookup(settings)
        progress.advance(task)
        memory = measure_memory(settings)
        progress.advance(task)
        ingest = measure_ingest(settings)
        progress.advance(task)
        end_to_end = measure_end_to_end(settings)
        progress.advance(task)
    data = {
        "machine": machine(),
        "settings": asdict(settings),
        "lookup": lookup,
        "memory": memory,
        "ingest": ingest,
        "end_to_end": end_to_end,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(data, out_dir / "kv-index.png")
    write_results(out_dir, "kv-index", data, _markdown(data))
    return data
