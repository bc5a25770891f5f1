"""Latency models: prediction error on simulated traffic, retraining time, predictor throughput.

1. **Prediction error.** Four simulated engines (``sim.engine``, the default profile with a
   smaller KV cache so that it fills) serve a synthetic workload in virtual time: requests
   share a few long system prompts, arrive at a rate that sweeps three times between 10% and
   190% of a mean (two load levels: short of saturation, and with queues at the peaks), and
   are routed at random. For every request the feature row is recorded as the router
   would see it on arrival (the chosen engine's queue, batch, KV usage, prefix-cache hit,
   uncomputed prompt tokens and KV tokens of decoding requests), then its true TTFT and TPOT
   when it finishes. The samples of the first 80% of requests go through the training
   server's own intake, window and retraining; MAPE is measured on the last 20% (later in
   time, never seen). Both target transforms (log, raw) are trained and compared.
2. **Retraining time.** Every window bucket filled to its bound (400 × 500 samples per model),
   one retraining of both models, timed.
3. **Model size.** Accuracy and prediction cost of a few (trees, depth) shapes, the anchor's
   200 × 6 first, each trained on the same samples of the traffic of (1) with other seeds: the
   measurement behind the trainer's default size.
4. **Predictor throughput.** One ``llm-epp-predictor`` process serving the model from (1),
   closed-loop load of ``POST /predict/bulk/strict`` calls of 100 rows at a few
   concurrencies, in the EPP's binary form and in JSON: calls/s, p50/p99 latency and the
   server's CPU time per call. The predictor runs on a CPU of its own and the load generator
   on the others, but other jobs on a shared machine compete, so the measured calls/s is a
   lower bound; what one instance can serve on one core of its own is 1 / (server CPU time
   per call), reported beside it. The in-process CPU time of each step of a call, and of the
   whole call through the app without HTTP, show where that time goes.

``--throughput-only`` runs (1) at the first load level only, skips (2) and (3), then runs (4).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import orjson
from rich.progress import Progress

from bench.harness.loadgen import closed_loop
from predictor.bulk import predictions_text
from predictor.models import ModelSet, build_model_set
from predictor.server import create_app
from predictor.settings import PredictorSettings
from sim.engine import Engine, EngineConfig, EngineRequest, load_profile
from sim.measure.report import machine, markdown_table, write_results
from sim.processes import BIN, free_port, http_ok, spawn, wait_until
from trainer.artifacts import MANIFEST_NAME, Manifest, parse_manifest
from trainer.features import FEATURE_COLUMNS, decode_feature_matrix, decode_feature_rows
from trainer.service import TrainerService
from trainer.settings import TrainerSettings
from trainer.window import KV_STEPS, NUM_BUCKETS, PREFIX_STEPS, QUEUE_EDGES
from wire.latency_binary import FEATURE_ROWS_TYPE, decode_rows, encode_predictions, encode_rows


@dataclass
class PredictorBenchSettings:
    engines: int = 4
    requests: int = 16_000
    kv_blocks: int = 6_000
    """KV blocks per engine (16 tokens each): small enough for the cache to fill under load."""
    system_prompts: int = 8
    mean_rates_per_engine: tuple[float, ...] = (4.5, 6.0)
    """Requests/s per engine, averaged over a sweep from 10% to 190% of it: one run per value.
    At 4.5 the engines stay short of saturation; at 6.0 queues form and the KV cache fills at
    the peaks."""
    train_fraction: float = 0.8
    model_sizes: tuple[tuple[int, int], ...] = ((200, 6), (120, 5), (60, 5))
    """(trees, depth) of the models compared in "Model size"; the first is the reference. 60 × 5
    halves the trees of the trainer's default: the candidate for a cheaper predictor call."""
    size_seeds: tuple[int, ...] = (1, 2, 3)
    """Seeds of the traffic (and of training) each size is compared on, at every load level."""
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    rows_per_call: int = 100
    load_seconds: float = 5.0
    encodings: tuple[str, ...] = ("binary", "json")
    """Bodies of the throughput runs: the EPP's binary matrices (``wire.latency_binary``), JSON."""
    pin_server_cpu: bool = True
    """On a machine of 2+ CPUs, run the predictor on the last CPU and the load generator on the
    others, so that they do not take turns on one core."""
    throughput_only: bool = False
    """Train one model (the first load level, log target) and measure only its serving cost:
    no transform or model-size comparison, no retraining time (``--throughput-only``)."""
    seed: int = 0


# ---------------------------------------------------------------- simulated traffic


@dataclass
class SimulatedRequest:
    features: dict[str, Any]
    arrival: float
    step_wait_ms: float
    """Time from arrival to the end of the engine's step in progress: part of the TTFT that no
    router can see (a diagnostic only)."""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


def simulate_traffic(
    settings: PredictorBenchSettings, mean_rate_per_engine: float, progress: Progress
) -> list[SimulatedRequest]:
    """Run the workload through ``settings.engines`` engines in virtual time; one record per request."""
    rng = np.random.default_rng(settings.seed)
    profile = load_profile("default")
    config = EngineConfig(
        max_num_seqs=profile.engine.max_num_seqs,
        max_num_batched_tokens=profile.engine.max_num_batched_tokens,
        block_size=profile.engine.block_size,
        num_gpu_blocks=settings.kv_blocks,
        max_model_len=profile.engine.max_model_len,
    )
    engines = [Engine(config, profile.cost, range(100, 200)) for _ in range(settings.engines)]
    in_flight: list[Any] = [None] * len(engines)
    system = [
        rng.integers(1_000, 30_000, int(rng.integers(256, 2048))).tolist()
        for _ in range(settings.system_prompts)
    ]
    arrivals = _arrival_times(settings, mean_rate_per_engine, rng)
    records: dict[str, SimulatedRequest] = {}
    requests: dict[str, EngineRequest] = {}
    task = progress.add_task(
        f"simulated traffic at {mean_rate_per_engine} req/s/engine", total=settings.requests
    )
    next_arrival = 0
    while True:
        arrival = arrivals[next_arrival] if next_arrival < len(arrivals) else np.inf
        step_end, busy = min(
            ((step.end_time, i) for i, step in enumerate(in_flight) if step is not None), default=(np.inf, -1)
        )
        if arrival == np.inf and busy < 0:
            break
        if arrival <= step_end:
            index = int(rng.integers(len(engines)))
            request_id = f"r{next_arrival}"
            prompt = (
                system[int(rng.integers(len(system)))]
                + rng.integers(1_000, 30_000, int(rng.integers(16, 1_500))).tolist()
            )
            request = EngineRequest(request_id, prompt, int(rng.integers(8, 300)))
            features = _router_view(engines[index])
            engines[index].add_request(request, arrival)
            hits = len(engines[index].kv_cache.get_computed_blocks(request)) * config.block_size
            features["input_token_length"] = len(prompt)
            features["prefix_cache_score"] = hits / len(prompt)
            step = in_flight[index]
            step_wait_ms = (step.end_time - arrival) * 1e3 if step is not None else 0.0
            records[request_id] = SimulatedRequest(features, arrival, step_wait_ms)
            requests[request_id] = request
            next_arrival += 1
            if in_flight[index] is None:
                in_flight[index] = engines[index].schedule(arrival)
            progress.advance(task)
        else:
            engine, step = engines[busy], in_flight[busy]
            engine.finish_step(step, step_end)
            in_flight[busy] = engine.schedule(step_end)
    for request_id, record in records.items():
        request = requests[request_id]
        record.ttft_ms = (request.first_token_time - record.arrival) * 1e3
        if request.num_output_tokens > 1:
            decode_s = request.finish_time - request.first_token_time
            record.tpot_ms = decode_s / (request.num_output_tokens - 1) * 1e3
    return list(records.values())


def _arrival_times(
    settings: PredictorBenchSettings, mean_rate_per_engine: float, rng: np.random.Generator
) -> np.ndarray:
    """Poisson arrivals whose rate sweeps sinusoidally between 10% and 190% of the mean, 3 times."""
    mean_rate = mean_rate_per_engine * settings.engines
    duration = settings.requests / mean_rate
    times, now = [], 0.0
    while len(times) < settings.requests:
        rate = mean_rate * (1.0 + 0.9 * np.sin(2 * np.pi * 3 * now / duration))
        now += float(rng.exponential(1.0 / max(rate, 0.1 * mean_rate)))
        times.append(now)
    return np.array(times)


def _router_view(engine: Engine) -> dict[str, Any]:
    """What a router knows about ``engine`` before adding a request to it."""
    prefill = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in engine.waiting)
    prefill += sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in engine.running)
    decode = sum(r.num_tokens for r in engine.running if r.num_computed_tokens >= r.num_prompt_tokens)
    return {
        "kv_cache_percentage": float(engine.kv_usage),
        "num_request_waiting": engine.num_waiting,
        "num_request_running": engine.num_running,
        "num_tokens_generated": 0,
        "pod_type": "",
        "prefill_tokens_in_flight": prefill,
        "decode_tokens_in_flight": decode,
        "endpoint_class": 0,
    }


# ---------------------------------------------------------------- prediction error


def load_served(model_dir: Path, manifest: Manifest) -> ModelSet:
    blobs = {name: (model_dir / info.file).read_bytes() for name, info in manifest.models.items()}
    return build_model_set(manifest, blobs, loaded_at=manifest.created, source=str(model_dir))


def measure_error(
    records: list[SimulatedRequest],
    model_dir: Path,
    transform: str,
    settings: PredictorBenchSettings,
    *,
    without_step_wait: bool = False,
    size: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Train through the trainer's own intake and window on the first requests; MAPE on the rest.

    ``without_step_wait``: the diagnostic run, on TTFTs less the unobservable wait for the step
    in progress, to show how much of the TTFT error that wait causes. ``size``: (trees, depth)
    of the models, instead of the trainer's defaults.
    """
    if without_step_wait:
        records = [replace(r, ttft_ms=r.ttft_ms - r.step_wait_ms) for r in records]
    cut = int(len(records) * settings.train_fraction)
    shape = {} if size is None else {"n_estimators": size[0], "max_depth": size[1]}
    service = TrainerService(
        TrainerSettings(model_dir=model_dir, target_transform=transform, seed=settings.seed, **shape)
    )
    service.add_samples(
        [
            {**r.features, "actual_ttft_ms": r.ttft_ms, "actual_tpot_ms": r.tpot_ms, "timestamp": r.arrival}
            for r in records[:cut]
        ]
    )
    manifest = asyncio.run(service.retrain())
    assert manifest is not None
    models = load_served(model_dir, manifest)
    test = records[cut:]
    ttft_pred, tpot_pred = models.predict(decode_feature_rows([r.features for r in test]))
    ttft = np.array([r.ttft_ms for r in test])
    tpot = np.array([r.tpot_ms for r in test])
    measured = tpot > 0
    return {
        "transform": transform,
        "train_requests": cut,
        "test_requests": len(test),
        "window_samples": {name: len(window) for name, window in service.windows.items()},
        "ttft_mape": float(np.mean(np.abs(ttft_pred - ttft) / ttft)),
        "tpot_mape": float(np.mean(np.abs(tpot_pred[measured] - tpot[measured]) / tpot[measured])),
        "holdout_mape": {name: info.holdout.mape for name, info in manifest.models.items()},
        "ttft_ms_percentiles": [float(v) for v in np.percentile(ttft, [10, 50, 90, 99])],
        "tpot_ms_percentiles": [float(v) for v in np.percentile(tpot[measured], [10, 50, 90, 99])],
        "_scatter": (ttft[:2000].tolist(), ttft_pred[:2000].tolist()),
    }


# ---------------------------------------------------------------- model size


def compare_model_sizes(
    settings: PredictorBenchSettings, scratch: Path, progress: Progress
) -> dict[str, Any]:
    """Each of ``settings.model_sizes`` trained on the same samples, for every seed of
    ``settings.size_seeds`` at every load level: MAPE on the later requests (also on TTFTs less
    the step wait, where model capacity, not unobservable noise, limits the error) and the
    in-process CPU time of predicting one call's rows with both models."""
    cases = []
    for seed in settings.size_seeds:
        seeded = replace(settings, seed=seed)
        for rate in settings.mean_rates_per_engine:
            records = simulate_traffic(seeded, rate, progress)
            rows = decode_feature_rows([r.features for r in records[-settings.rows_per_call :]])
            by_size = {}
            for trees, depth in settings.model_sizes:
                model_dir = scratch / f"seed-{seed}-rate-{rate}-{trees}x{depth}"
                error = measure_error(records, model_dir, "log", seeded, size=(trees, depth))
                without_wait = measure_error(
                    records, model_dir / "no-wait", "log", seeded, without_step_wait=True, size=(trees, depth)
                )
                models = load_served(model_dir, parse_manifest((model_dir / MANIFEST_NAME).read_bytes()))
                by_size[f"{trees}x{depth}"] = {
                    "ttft_mape": error["ttft_mape"],
                    "tpot_mape": error["tpot_mape"],
                    "ttft_mape_without_step_wait": without_wait["ttft_mape"],
                    "predict_both_models_us": _cpu_us(partial(models.predict, rows), 500),
                }
            cases.append({"seed": seed, "mean_rate_per_engine": rate, "by_size": by_size})
    return {"cases": cases, "summary": _size_summary(cases, settings.model_sizes)}


def _size_summary(cases: list[dict[str, Any]], sizes: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """Per size: the mean of each measure over the cases, and its worst case against the first size."""
    reference = f"{sizes[0][0]}x{sizes[0][1]}"
    summary = []
    for trees, depth in sizes:
        key = f"{trees}x{depth}"
        entry: dict[str, Any] = {"trees": trees, "depth": depth}
        for measure in ("ttft_mape", "tpot_mape", "ttft_mape_without_step_wait", "predict_both_models_us"):
            values = np.array([c["by_size"][key][measure] for c in cases])
            entry[measure] = float(values.mean())
            if measure != "predict_both_models_us":
                differences = values - np.array([c["by_size"][reference][measure] for c in cases])
                entry[f"{measure}_worst_vs_reference"] = float(differences.max())
        summary.append(entry)
    return summary


# ---------------------------------------------------------------- retraining time


def measure_retrain(settings: PredictorBenchSettings, progress: Progress) -> dict[str, Any]:
    """Fill every bucket of both windows to its bound, then time one retraining."""
    task = progress.add_task("retraining a full window", total=1)
    rng = np.random.default_rng(settings.seed)
    with tempfile.TemporaryDirectory() as directory:
        service = TrainerService(TrainerSettings(model_dir=Path(directory)))
        capacity = service.settings.bucket_capacity
        features = _matrix_filling_every_bucket(capacity, rng)
        ttft = 20 + 0.04 * features[:, 8] + 25 * features[:, 2] + 10 * features[:, 0]
        tpot = 6 + 0.25 * features[:, 3] + 30 * features[:, 0]
        service.windows["ttft"].add(features, ttft * rng.uniform(0.95, 1.05, len(ttft)))
        service.windows["tpot"].add(features, tpot * rng.uniform(0.95, 1.05, len(tpot)))
        samples = {name: len(window) for name, window in service.windows.items()}
        started = time.perf_counter()
        manifest = asyncio.run(service.retrain())
        elapsed = time.perf_counter() - started
        registry = service.metrics.registry
        per_model = {
            name: registry.get_sample_value("trainer_retrain_duration_seconds_sum", {"model": name})
            for name in ("ttft", "tpot")
        }
    progress.advance(task)
    assert manifest is not None
    return {
        "samples_per_model": samples,
        "buckets_filled": NUM_BUCKETS,
        "bucket_capacity": capacity,
        "retrain_both_s": round(elapsed, 2),
        "fit_s": {name: round(value or 0.0, 2) for name, value in per_model.items()},
        "trees": service.settings.n_estimators,
        "max_depth": service.settings.max_depth,
    }


def _matrix_filling_every_bucket(capacity: int, rng: np.random.Generator) -> np.ndarray:
    n = NUM_BUCKETS * capacity
    bucket = np.repeat(np.arange(NUM_BUCKETS), capacity)
    rest, prefix_step = np.divmod(bucket, PREFIX_STEPS)
    queue, kv_step = np.divmod(rest, KV_STEPS)
    lows = np.r_[0, QUEUE_EDGES]
    highs = np.r_[QUEUE_EDGES, 40]
    columns = {
        "kv_cache_percentage": (kv_step + rng.uniform(0.05, 0.95, n)) / KV_STEPS,
        "input_token_length": rng.integers(1, 8000, n),
        "num_request_waiting": rng.integers(lows[queue], highs[queue]),
        "num_request_running": rng.integers(0, 256, n),
        "num_tokens_generated": np.zeros(n),
        "prefix_cache_score": (prefix_step + rng.uniform(0.05, 0.95, n)) / PREFIX_STEPS,
        "prefill_tokens_in_flight": rng.integers(0, 50_000, n),
        "decode_tokens_in_flight": rng.integers(0, 200_000, n),
    }
    matrix = np.zeros((n, len(FEATURE_COLUMNS)), np.float32)
    for name, values in columns.items():
        matrix[:, FEATURE_COLUMNS.index(name)] = values
    matrix[:, FEATURE_COLUMNS.index("effective_input_tokens")] = (
        1 - columns["prefix_cache_score"]
    ) * columns["input_token_length"]
    matrix[:, FEATURE_COLUMNS.index("is_queued")] = columns["num_request_waiting"] > 0
    return matrix


# ---------------------------------------------------------------- predictor throughput


def measure_throughput(
    model_dir: Path, rows: list[dict[str, Any]], settings: PredictorBenchSettings, progress: Progress
) -> list[dict[str, Any]]:
    runs = [(e, c) for e in settings.encodings for c in settings.concurrencies]
    task = progress.add_task("predictor throughput (closed loop)", total=len(runs))
    port = free_port()
    url = f"http://127.0.0.1:{port}/predict/bulk/strict"
    bodies = {
        "json": (json.dumps({"requests": rows}).encode(), "application/json"),
        "binary": (encode_rows(rows), FEATURE_ROWS_TYPE),
    }
    cpus = sorted(os.sched_getaffinity(0))
    pinned = settings.pin_server_cpu and len(cpus) > 1
    cases = []
    with tempfile.TemporaryDirectory() as logs:
        argv = [
            str(BIN / "llm-epp-predictor"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model-dir",
            str(model_dir),
            "--log-level",
            "warning",
        ]
        predictor = spawn("predictor", argv, Path(logs))
        if pinned:  # before it starts its threads, which inherit the mask
            os.sched_setaffinity(predictor.process.pid, cpus[-1:])
            os.sched_setaffinity(0, cpus[:-1])
        try:
            wait_until(predictor, http_ok(f"{url.rsplit('/predict', 1)[0]}/readyz"))
            for encoding, concurrency in runs:
                body, content_type = bodies[encoding]
                load = partial(closed_loop, url, body, concurrency=concurrency, content_type=content_type)
                asyncio.run(load(duration_s=0.5, warmup_s=0.0))  # warm-up, outside the CPU count
                load_average = os.getloadavg()[0]
                cpu, own_cpu = predictor.cpu_seconds(), time.process_time()
                result = asyncio.run(load(duration_s=settings.load_seconds, warmup_s=0.0))
                server_ms = (predictor.cpu_seconds() - cpu) / max(result.requests, 1) * 1e3
                cases.append(
                    {
                        "encoding": encoding,
                        "concurrency": concurrency,
                        **result.summary(),
                        "server_cpu_ms_per_call": round(server_ms, 3),
                        "server_bound_calls_per_s": round(1e3 / server_ms, 1),
                        "loadgen_cpu_ms_per_call": round(
                            (time.process_time() - own_cpu) / max(result.requests, 1) * 1e3, 3
                        ),
                        "load_average_before": round(load_average, 2),
                        "server_pinned": pinned,
                    }
                )
                progress.advance(task)
        finally:
            predictor.stop()
            os.sched_setaffinity(0, cpus)
    return cases


def measure_call_cost(model_dir: Path, rows: list[dict[str, Any]], repeats: int = 500) -> dict[str, float]:
    """In-process CPU time of the steps of one call, and of the whole call through the app (ASGI,
    no HTTP) in each encoding: what is left of the server's CPU time per call is uvicorn's and
    the kernel's."""
    bodies = {
        "json": (json.dumps({"requests": rows}).encode(), "application/json"),
        "binary": (encode_rows(rows), FEATURE_ROWS_TYPE),
    }
    app = create_app(PredictorSettings(model_dir=model_dir, poll_interval_s=3600))
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def whole_call_us(encoding: str) -> float:
        body, content_type = bodies[encoding]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/predict/bulk/strict",
            "raw_path": b"/predict/bulk/strict",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        await app(dict(scope), receive, send)
        started = time.process_time()
        for _ in range(repeats):
            await app(dict(scope), receive, send)
        return round((time.process_time() - started) / repeats * 1e6, 1)

    async def timed() -> dict[str, float]:
        async with app.router.lifespan_context(app):
            assert await app.state.reloader.poll_once()
            models = app.state.reloader.current
            features = decode_feature_rows(rows)
            ttft, tpot = models.predict(features)
            binary = bodies["binary"][0]
            steps: dict[str, Callable[[], Any]] = {
                "json_parse_us": lambda: orjson.loads(bodies["json"][0]),
                "decode_rows_us": lambda: decode_feature_rows(rows),
                "decode_binary_rows_us": lambda: decode_feature_matrix(decode_rows(binary)),
                "predict_both_models_us": lambda: models.predict(features),
                "response_text_us": lambda: predictions_text(models, ttft, tpot, {}),
                "binary_response_us": lambda: encode_predictions(ttft, tpot),
            }
            costs = {name: _cpu_us(step, repeats) for name, step in steps.items()}
            for encoding in bodies:
                costs[f"whole_{encoding}_call_in_process_us"] = await whole_call_us(encoding)
        assert set(statuses) == {200}, statuses
        return costs

    return asyncio.run(timed())


def _cpu_us(step: Callable[[], Any], repeats: int) -> float:
    step()
    started = time.process_time()
    for _ in range(repeats):
        step()
    return round((time.process_time() - started) / repeats * 1e6, 1)


# ---------------------------------------------------------------- report


def _plot(data: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.set_xlabel("concurrent callers")
    left.set_ylabel(f"calls/s ({data['settings']['rows_per_call']} rows each)")
    twin = left.twinx()
    for encoding in data["settings"]["encodings"]:
        cases = [c for c in data["throughput"] if c["encoding"] == encoding]
        x = [c["concurrency"] for c in cases]
        left.plot(x, [c["rps"] for c in cases], "o-", label=f"{encoding} calls/s")
        twin.plot(x, [c["p99_ms"] for c in cases], "s--", label=f"{encoding} p99 ms")
    left.legend(loc="upper left", fontsize="small")
    twin.legend(loc="lower right", fontsize="small")
    twin.set_ylabel("p99 latency (ms)")
    left.set_title("One predictor instance")
    first = data["error"][0]
    actual, predicted = first["by_transform"]["log"]["_scatter"]
    right.loglog(actual, predicted, ".", markersize=2, alpha=0.5)
    limits = [min(actual), max(actual)]
    right.plot(limits, limits, "k-", linewidth=0.8)
    right.set_xlabel("actual TTFT (ms)")
    right.set_ylabel("predicted TTFT (ms)")
    right.set_title(f"Later simulated requests, {first['mean_rate_per_engine']} req/s/engine (log model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    sections = [
        "# Latency models: prediction error, retraining, predictor throughput",
        f"Machine: {m['cpus']} CPUs, Python {m['python']}, {m['date']}. The load generator and the "
        "predictor share these CPUs.",
        _error_section(data),
    ]
    if data["retrain"] is not None:
        sections.append(_retrain_section(data["retrain"]))
    if data["model_size"] is not None:
        sections.append(_model_size_section(data))
    sections += [_throughput_section(data), "![throughput and error](predictor.png)"]
    return "\n\n".join(sections)


def _error_section(data: dict[str, Any]) -> str:
    s = data["settings"]
    error_rows = []
    for level in data["error"]:
        for e in level["by_transform"].values():
            error_rows.append(
                [
                    level["mean_rate_per_engine"],
                    "/".join(str(v) for v in level["num_request_waiting_p50_p90_p99"]),
                    "/".join(str(v) for v in level["kv_cache_percentage_p50_p90_p99"]),
                    "/".join(f"{v:.0f}" for v in e["ttft_ms_percentiles"]),
                    e["transform"],
                    f"**{e['ttft_mape'] * 100:.1f}%**",
                    f"**{e['tpot_mape'] * 100:.1f}%**",
                    " / ".join(f"{(e['holdout_mape'].get(n) or 0) * 100:.1f}%" for n in ("ttft", "tpot")),
                ]
            )
    first = data["error"][0]["by_transform"]["log"]
    step_wait = "; ".join(
        f"at {level['mean_rate_per_engine']} req/s/engine it is "
        f"{level['step_wait_mean_share_of_ttft'] * 100:.0f}% of the TTFT on average, and without it "
        f"the TTFT MAPE is {level['ttft_mape_without_step_wait'] * 100:.1f}%"
        for level in data["error"]
    )
    return "\n\n".join(
        [
            "## Prediction error on simulated traffic",
            f"{s['engines']} simulated engines (default profile, {s['kv_blocks']} KV blocks each), "
            f"{s['requests']} requests routed at random per load level, the arrival rate sweeping 10-190% "
            f"of the level's mean. Trained on the first {first['train_requests']} requests through the "
            f"trainer's intake and window, tested on the last {first['test_requests']} (later in time). "
            "Percentiles are p50/p90/p99 of what the router saw on arrival, and p10/p50/p90/p99 of TTFT.",
            markdown_table(
                [
                    "req/s/engine",
                    "queue",
                    "KV usage",
                    "TTFT ms",
                    "target",
                    "TTFT MAPE",
                    "TPOT MAPE",
                    "holdout MAPE TTFT / TPOT",
                ],
                error_rows,
            ),
            "Part of every TTFT is the wait for the step the engine is running when the request "
            "arrives, which no router observes. A model trained and tested on TTFT less that wait (a "
            f"simulator-only diagnostic) shows how much error it causes: {step_wait}.",
        ]
    )


def _retrain_section(r: dict[str, Any]) -> str:
    return (
        "## Retraining a full window\n\n"
        f"{r['buckets_filled']} buckets × {r['bucket_capacity']} = "
        f"{r['samples_per_model']['ttft']} samples per model, {r['trees']} trees of depth "
        f"{r['max_depth']}: one retraining of both models took "
        f"**{r['retrain_both_s']} s** (TTFT {r['fit_s']['ttft']} s, TPOT {r['fit_s']['tpot']} s)."
    )


def _model_size_section(data: dict[str, Any]) -> str:
    s = data["settings"]
    default = TrainerSettings.model_fields
    default_size = (default["n_estimators"].default, default["max_depth"].default)
    size_rows = []
    for e in data["model_size"]["summary"]:
        label = f"{e['trees']} × {e['depth']}"
        if (e["trees"], e["depth"]) == default_size:
            label += " (default)"
        size_rows.append(
            [
                label,
                f"**{e['ttft_mape'] * 100:.2f}%** ({e['ttft_mape_worst_vs_reference'] * 100:+.2f})",
                f"**{e['tpot_mape'] * 100:.2f}%** ({e['tpot_mape_worst_vs_reference'] * 100:+.2f})",
                f"{e['ttft_mape_without_step_wait'] * 100:.2f}% "
                f"({e['ttft_mape_without_step_wait_worst_vs_reference'] * 100:+.2f})",
                f"{e['predict_both_models_us']:.0f}",
            ]
        )
    case_rows = [
        [c["seed"], c["mean_rate_per_engine"]]
        + [
            " / ".join(f"{v[m] * 100:.2f}" for m in ("ttft_mape", "tpot_mape", "ttft_mape_without_step_wait"))
            for v in c["by_size"].values()
        ]
        for c in data["model_size"]["cases"]
    ]
    sizes = [f"{t} × {d}" for t, d in s["model_sizes"]]
    return "\n\n".join(
        [
            "## Model size",
            f"Models of each size (trees × depth, learning rate {default['learning_rate'].default}, log "
            f"target) trained on the same samples, on the traffic of seeds {list(s['size_seeds'])} at each "
            "load level above: MAPE on the later requests, averaged over those cases, with the worst "
            f"case's difference from {sizes[0]} in points (positive: worse); TTFT MAPE also on TTFTs less "
            "the step wait, where the model's capacity rather than what no router sees limits the "
            f"error; and the in-process CPU time of predicting {s['rows_per_call']} rows with both models.",
            markdown_table(
                ["size", "TTFT MAPE", "TPOT MAPE", "TTFT MAPE without step wait", "both models µs"],
                size_rows,
            ),
            "Each case, TTFT / TPOT / TTFT-without-step-wait MAPE (%):",
            markdown_table(["seed", "req/s/engine", *sizes], case_rows),
        ]
    )


def _throughput_section(data: dict[str, Any]) -> str:
    m, s, cost = data["machine"], data["settings"], data["call_cost"]
    default = TrainerSettings.model_fields
    throughput_rows = [
        [
            c["encoding"],
            c["concurrency"],
            c["rps"],
            c["p50_ms"],
            c["p99_ms"],
            c["server_cpu_ms_per_call"],
            f"**{c['server_bound_calls_per_s']}**",
            c["loadgen_cpu_ms_per_call"],
            c["load_average_before"],
            c["statuses"],
        ]
        for c in data["throughput"]
    ]
    pinned = data["throughput"][0]["server_pinned"]
    placement = (
        "The predictor runs on a CPU of its own (the last one) and the load generator on the others"
        if pinned
        else f"The load generator shares the {m['cpus']} CPUs with the predictor"
    )
    return "\n\n".join(
        [
            "## Predictor throughput",
            f"Closed loop, `POST /predict/bulk/strict`, {s['rows_per_call']} rows per call in each "
            "encoding (binary: the EPP's float64 feature matrix and float32 predictions; json: "
            '`{"requests": [...]}`), one instance serving the models of the first load level '
            f"({default['n_estimators'].default} trees of depth {default['max_depth'].default}), "
            f"{s['load_seconds']} s per concurrency after a 0.5 s warm-up. {placement}; any other work "
            "on the machine competes (a 1-minute load average above about 1 before a run means it "
            "did), so calls/s is a lower bound; the server-bound calls/s, 1 / (server CPU time per "
            "call), is what the instance serves on a core of its own.",
            markdown_table(
                [
                    "encoding",
                    "concurrency",
                    "calls/s",
                    "p50 ms",
                    "p99 ms",
                    "server CPU ms/call",
                    "server-bound calls/s",
                    "loadgen CPU ms/call",
                    "load avg before",
                    "statuses",
                ],
                throughput_rows,
            ),
            f"In-process CPU time of one call's steps: JSON parse (orjson) {cost['json_parse_us']} µs, "
            f"JSON row decoding {cost['decode_rows_us']} µs against binary {cost['decode_binary_rows_us']} "
            f"µs, both models ({s['rows_per_call']} rows, XGBoost C API) {cost['predict_both_models_us']} "
            f"µs, JSON response text {cost['response_text_us']} µs against binary "
            f"{cost['binary_response_us']} µs; the whole call through the app without HTTP "
            f"{cost['whole_json_call_in_process_us']} µs in JSON, {cost['whole_binary_call_in_process_us']} "
            "µs in binary. The rest of the server CPU time per call is uvicorn's (httptools, uvloop) "
            "and the kernel's TCP.",
        ]
    )


def measure_errors(
    settings: PredictorBenchSettings, rate: float, scratch: Path, progress: Progress
) -> dict[str, Any]:
    """Prediction error at one load level, for both target transforms, plus the step-wait diagnostic."""
    records = simulate_traffic(settings, rate, progress)
    task = progress.add_task(f"training at {rate} req/s/engine", total=3)
    by_transform = {}
    for transform in ("log", "raw"):
        by_transform[transform] = measure_error(records, scratch / transform, transform, settings)
        progress.advance(task)
    diagnostic = measure_error(records, scratch / "diagnostic", "log", settings, without_step_wait=True)
    progress.advance(task)
    return {
        "mean_rate_per_engine": rate,
        "kv_cache_percentage_p50_p90_p99": [
            round(float(v), 3)
            for v in np.percentile([r.features["kv_cache_percentage"] for r in records], [50, 90, 99])
        ],
        "num_request_waiting_p50_p90_p99": [
            float(v)
            for v in np.percentile([r.features["num_request_waiting"] for r in records], [50, 90, 99])
        ],
        "step_wait_mean_share_of_ttft": float(np.mean([r.step_wait_ms / r.ttft_ms for r in records])),
        "ttft_mape_without_step_wait": diagnostic["ttft_mape"],
        "by_transform": by_transform,
        "_rows": [r.features for r in records[-settings.rows_per_call :]],
    }


def run(out_dir: Path, settings: PredictorBenchSettings | None = None) -> dict[str, Any]:
    settings = settings or PredictorBenchSettings()
    with Progress() as progress, tempfile.TemporaryDirectory() as scratch:
        rates = (
            settings.mean_rates_per_engine[:1] if settings.throughput_only else settings.mean_rates_per_engine
        )
        error = [
            measure_errors(settings, rate, Path(scratch) / f"rate-{i}", progress)
            for i, rate in enumerate(rates)
        ]
        model_size, retrain = None, None
        if not settings.throughput_only:
            model_size = compare_model_sizes(settings, Path(scratch) / "sizes", progress)
            retrain = measure_retrain(settings, progress)
        model_dir = Path(scratch) / "rate-0" / "log"
        rows = error[0].pop("_rows")
        call_cost = measure_call_cost(model_dir, rows)
        throughput = measure_throughput(model_dir, rows, settings, progress)
    data = {
        "machine": machine(),
        "settings": asdict(settings),
        "error": error,
        "model_size": model_size,
        "retrain": retrain,
        "call_cost": call_cost,
        "throughput": throughput,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(data, out_dir / "predictor.png")
    for level in error:
        level.pop("_rows", None)
        for result in level["by_transform"].values():
            result.pop("_scatter")
    write_results(out_dir, "predictor", data, _markdown(data))
    return data
