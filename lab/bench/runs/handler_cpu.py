"""The EPP handler's own CPU per short request, in process: no Envoy, no gRPC, no sockets.

One ~200-token non-streamed completion goes through ``ExtProcStream`` as the local gateway's
Envoy sends it (request headers announcing a BUFFERED body, the body, response headers; the
reply to those skips the response body), routed by a shipped config over four endpoints with
the live EPP's lifecycle observers (prediction report, decision log, the live page's recent
decisions, the director's request metrics) and its tokenizer cache. The predictor is an
in-process stand-in answering constant predictions: the rows and the answer go through the
predictor client's wire form, but its HTTP round trip is not counted.

Cases: the same prompt every time (what ``stack_overhead``'s short requests send: the prefix
is cached, so the predicted-latency producer skips the prediction), and a new prompt every time
(every request is predicted). Reports process CPU µs per request (best of ``--trials``); with
``--profile``, the top functions by own time from cProfile.

``--long``: ~26k-token chat turns instead (``bench.runs.tokenize_bench``'s agent-like conversations),
with the live EPP's tokenizer cache: each sample is a conversation seen for the first time, then
its next turn (extending it by a few hundred tokens). Reports the median CPU ms of each.

    .venv/bin/python -m bench.runs.handler_cpu [--config predicted-latency] [--profile] [--long]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProtocolConfiguration,
)
from prometheus_client import CollectorRegistry

import epp.plugin_types  # noqa: F401  (registers every plugin type)
from bench.runs.tokenize_bench import CHAT_PATH, Conversations, TokenizeBenchSettings
from epp.configs import config_path
from epp.datalayer.endpoints import EndpointStore
from epp.extproc.stream import ExtProcStream, routes
from epp.latency.client import read_predictions
from epp.latency.metrics import PredictionMetrics
from epp.latency.report import PredictionReport
from epp.metrics import ModelLabels, RequestMetrics
from epp.observability.decision import DecisionLog
from epp.observability.recent import RecentDecisions
from epp.requestcontrol.completion_log import MeteringSettings
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext
from epp.scheduling.predictor import Prediction
from epp.scheduling.types import Endpoint, EngineMetrics
from epp.settings import EppSettings
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from wire.latency import FeatureRowDict
from wire.latency_binary import MODEL_VERSION_HEADER, encode_predictions, encode_rows

PROMPT = "The quick brown fox jumps over the lazy dog. " * 10

# What the local gateway's Envoy announces (``sim.envoy_config``): the body comes whole, once.
BUFFERED = ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED)


class ConstantPredictor:
    """100 ms TTFT, 10 ms TPOT on every endpoint, through the wire form as the predictor client
    sends and reads it (the rows encoded, the answer decoded), without the HTTP between;
    training samples are dropped."""

    async def predict(self, rows: Sequence[FeatureRowDict]) -> list[Prediction]:
        encode_rows(rows)
        answer = encode_predictions(np.full(len(rows), 100.0), np.full(len(rows), 10.0))
        return read_predictions(answer, {MODEL_VERSION_HEADER.lower(): "1"})

    def add_training(self, samples: Sequence[dict[str, Any]]) -> None:
        pass

    def request_retrain(self) -> None:
        pass


def _headers(pairs: dict[str, str]) -> HttpHeaders:
    return HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    )


def _messages(body: bytes, request_id: str, path: str = "/v1/completions") -> list[ProcessingRequest]:
    request = {":path": path, ":method": "POST", "content-type": "application/json"}
    return [
        ProcessingRequest(
            request_headers=_headers({**request, "x-request-id": request_id}), protocol_config=BUFFERED
        ),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)),
        ProcessingRequest(response_headers=_headers({":status": "200", "content-type": "application/json"})),
    ]


def streamed_chat_wire(number: int, chunk: bytes) -> list[bytes]:
    """A streamed chat request's messages as Envoy sends them, to its response's first chunk
    (``chunk``, not the last)."""
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"{number} {PROMPT}"}],
            "max_tokens": 500,
            "stream": True,
        }
    ).encode()
    request = {":path": CHAT_PATH, ":method": "POST", "content-type": "application/json"}
    messages = [
        ProcessingRequest(
            request_headers=_headers({**request, "x-request-id": f"s{number}"}), protocol_config=BUFFERED
        ),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)),
        ProcessingRequest(response_headers=_headers({":status": "200", "content-type": "text/event-stream"})),
        ProcessingRequest(response_body=HttpBody(body=chunk, end_of_stream=False)),
    ]
    return [m.SerializeToString() for m in messages]


def make_director(
    config: str,
    tokenizer: ModelTokenizer | None = None,
    endpoints: int = 4,
    metering: MeteringSettings | None = None,
) -> Director:
    clock = time.monotonic
    store = EndpointStore()
    store.replace([Endpoint(f"e{i}", "10.0.0.1", 8000 + i) for i in range(endpoints)])
    for i in range(endpoints):
        store.record_scrape(f"e{i}", EngineMetrics(updated_at=clock()))
    context = PluginContext(clock=clock, rng=random.Random(1), latency_predictor=ConstantPredictor())
    pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path(config)), context)
    registry, labels = CollectorRegistry(), ModelLabels()
    observers = [PredictionReport(PredictionMetrics(registry, labels)), DecisionLog(), RecentDecisions()]
    lifecycle = RequestLifecycle(pipeline, observers)
    return Director(
        lifecycle,
        store,
        tokenizer
        or ModelTokenizer(
            TINY_MODEL_DIR, cache_bytes=EppSettings.model_fields["tokenizer_cache_bytes"].default
        ),
        RequestMetrics(registry, labels),
        clock,
        random.Random(1),
        metering=metering,
    )


def _batch(count: int, fresh: bool, start: int) -> list[list[bytes]]:
    """Each request's messages as they come off the wire (built before the clock starts, as they
    are built in Envoy: the EPP only parses them)."""
    batch = []
    for i in range(start, start + count):
        prompt = f"{i} {PROMPT}" if fresh else PROMPT
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 16}).encode()
        batch.append([m.SerializeToString() for m in _messages(body, f"r{i}")])
    return batch


async def _send(director: Director, wire: list[bytes]) -> None:
    """One request's ext_proc stream: each message parsed and answered as the gRPC server does."""
    stream = ExtProcStream(director, 64 << 20)
    for raw in wire:
        message = ProcessingRequest.FromString(raw)
        if routes(message):
            async for _ in stream.route(message):
                pass
        else:
            stream.answer(message)
    stream.close()


async def _requests(director: Director, batch: list[list[bytes]]) -> None:
    for wire in batch:
        await _send(director, wire)


async def _chat_cpu(director: Director, messages: list[dict[str, str]], request_id: str) -> float:
    """Process CPU seconds (worker threads included) of one chat request through the handler."""
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 64}).encode()
    wire = [m.SerializeToString() for m in _messages(body, request_id, CHAT_PATH)]
    started = time.process_time()
    await _send(director, wire)
    return time.process_time() - started


async def _long_turns(config: str, samples: int) -> tuple[list[float], list[float]]:
    """CPU seconds of ``samples`` ~26k-token chat turns seen for the first time, and of their next
    turns, on one event loop (as in the live EPP: its worker threads stay up)."""
    director = make_director(config)
    conversations = Conversations(TokenizeBenchSettings(), ModelTokenizer(TINY_MODEL_DIR))
    first, extension = [], []
    for session in range(-1, samples):  # session -1 warms the BPE word cache, as a live EPP's is
        messages = conversations.new(session)
        first.append(await _chat_cpu(director, messages, f"f{session}"))
        conversations.extend(messages)
        extension.append(await _chat_cpu(director, messages, f"x{session}"))
    return first[1:], extension[1:]


def measure_long(config: str, samples: int) -> dict[str, float]:
    """Median CPU ms of a ~26k-token chat turn seen for the first time, and of its next turn."""
    first, extension = asyncio.run(_long_turns(config, samples))
    return {"first seen": statistics.median(first) * 1e3, "extension": statistics.median(extension) * 1e3}


def measure(config: str, fresh: bool, requests: int, trials: int, endpoints: int = 4) -> float:
    """Best-of-``trials`` process CPU µs per request, routed over ``endpoints`` endpoints."""
    director = make_director(config, endpoints=endpoints)
    asyncio.run(_requests(director, _batch(200, fresh, 0)))  # warm up: tokenizer, caches, first labels
    best = float("inf")
    for trial in range(trials):
        batch = _batch(requests, fresh, (trial + 1) * requests)
        started = time.process_time()
        asyncio.run(_requests(director, batch))
        best = min(best, (time.process_time() - started) / requests * 1e6)
    return best


def profile(config: str, fresh: bool, requests: int, top: int) -> None:
    director = make_director(config)
    asyncio.run(_requests(director, _batch(200, fresh, 0)))
    batch = _batch(requests, fresh, requests)
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(_requests(director, batch))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="predicted-latency")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the repeated-prompt case")
    parser.add_argument("--long", action="store_true", help="26k-token chat turns: first seen, extension")
    parser.add_argument("--samples", type=int, default=15, help="conversations of the --long case")
    args = parser.parse_args()
    if args.long:
        for case, ms in measure_long(args.config, args.samples).items():
            print(f"{args.config}, 26k-token chat turn, {case}: {ms:.2f} ms CPU per request")
        return
    if args.profile:
        profile(args.config, False, args.requests, 40)
        return
    for fresh in (False, True):
        us = measure(args.config, fresh, args.requests, args.trials)
        case = "new prompt each request" if fresh else "same prompt each request"
        print(f"{args.config}, {case}: {us:.1f} µs CPU per request")


if __name__ == "__main__":
    main()
