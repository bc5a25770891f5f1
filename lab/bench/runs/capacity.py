"""``llm-epp-bench capacity``: the EPP's unit costs, measured here, and the sizing they give.

Unit costs, each measured on the machine this runs on:

* **per request** and **per metered chunk**: ISL ~1k / OSL 500 streamed chat answers, one in
  ``slo_every`` with ``x-slo-ttft-ms``/``x-slo-tpot-ms``, through the ``make run`` stack
  (``bench.runs.metering_cost``, 4 simulated replicas, predicted-latency): the EPP's CPU per request
  with first-token metering (the request handed off at its first token, finished from Envoy's
  access log: its own log entry is in the figure), and per chunk the full metering's extra CPU
  over it, divided by the chunks read. The live stack routes over 4 endpoints; what routing
  over ``pods`` costs more is measured in process (``bench.runs.handler_cpu``, a new prompt each
  request, so each is predicted) and added to the per-request figure.
* **per access-log entry** another replica handed off (every replica receives every entry, and
  finds most unknown): a batch of ``log_entries`` realistic ``HTTPAccessLogEntry`` parsed and
  handed to a director (``epp.extproc.access_log``), in process.
* **per scrape**: the EPP's scraper polling endpoints on the fast tick, in process, against a
  server in another process answering a real vLLM scrape that changes every time (a busy
  engine's: each one is parsed); the scraping thread's CPU per scrape.
* **per sync message and endpoint total applied**: a peer's ``ReplicaSyncState`` publishing the
  totals of 1 and of ``pods`` endpoints per message (``sync_bookings_per_endpoint`` bookings on
  each), another's ``receive`` timed, in process.
* **per prediction row**: the predictor app (in process, ASGI, no HTTP server) answering a
  binary bulk call of 100 rows with a model of the trainer's default shape trained on
  ``bench.runs.predictor_bench``'s simulated traffic.

The sizing (:func:`plan`) is arithmetic on those: see its docstring. llm-d's published figures
(:data:`LLM_D`) go beside ours, with where each came from.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from envoy.config.core.v3.base_pb2 import RequestMethod
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage
from rich.progress import Progress

from bench.runs import handler_cpu, metering_cost, predictor_bench, request_rate, scrape_share_cost
from bench.runs.idle_cost import VLLM_SCRAPE
from bench.runs.metering_cost import SHIPPED_SAMPLE_EVERY, MeteringCostSettings
from bench.runs.request_rate import SAMPLE_EVERY, TOKENIZER_LABELS, RequestRateSettings, TokenizerMode
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.scraper import MetricsScraper
from epp.extproc.access_log import log_entry
from epp.keepalive_http import KeepAliveHttp
from epp.load.peer_totals import PeerTotals
from epp.requestcontrol.completion_log import MeteringSettings
from epp.requestcontrol.director import REQUEST_ID_HEADER
from epp.scheduling.types import Endpoint
from epp.sync.state import ReplicaSyncState, SyncTargets, SyncTuning
from sim.envoy_config import Callout
from sim.measure.report import machine, markdown_table, save_figure, write_results

_TUNING = SyncTuning()


@dataclass(frozen=True)
class Published:
    """One of llm-d's published figures, and where it came from."""

    figure: str
    value: str
    source: str


_STUDIES = "llm-d-router test/perf/config/studyanalysis/"
LLM_D_REQUEST_US = 3.6 / 500 * 1e6 - 100 * 31
"""~4 ms: 3.6 cores at 500 QPS of 200-in / 100-out, less 100 chunks at ~31 µs."""
LLM_D_CHUNK_US = 31.0
"""The top of the 24–31 µs per streamed chunk its output-length study gives."""
LLM_D_SCRAPE_US = 7.5 / (100 * 20) * 1e6
"""7.5 idle cores for 100 pods scraped every 50 ms: 3.75 ms a scrape."""
LLM_D_PREDICTOR_SERVERS = {1_000: 2, 10_000: 4}
LLM_D: tuple[Published, ...] = (
    Published(
        "EPP CPU, 10 QPS, 200-token prompts, 100 / 1k / 5k / 10k output tokens",
        "0.60 / 1.00 / 2.46 / 3.71 cores (~24–31 µs per streamed chunk)",
        _STUDIES + "output_token_length_impact_analysis.md",
    ),
    Published(
        "EPP CPU, 500 QPS of 200-in / 100-out",
        "3.6 cores (~4 ms per request once its 100 chunks are taken off)",
        _STUDIES + "high_qps_small_token_comparison_analysis.md",
    ),
    Published(
        "EPP CPU, idle, 100 model pods at the 50 ms scrape tick", "~7.5 cores", "llm-d operations guide"
    ),
    Published(
        "Prediction servers (c4-standard-192)",
        "2 for 1,000 QPS (p99 49 ms), 4 for 10,000 QPS (p99 ~137 ms)",
        "llm-d latency predictor docs",
    ),
)


@dataclass
class CapacitySettings:
    qps: tuple[int, ...] = (1_000, 5_000, 10_000)
    pods: int = 100
    input_tokens: int = 1_000
    """A label: the live requests' prompts are ``metering.prompt_words`` words, ~1k tokens."""
    output_tokens: int = 500
    """Streamed: one SSE chunk per token."""
    sample_every: int = SHIPPED_SAMPLE_EVERY
    """One stream in this many is read chunk by chunk (first-token metering's calibration)."""
    utilisation: float = 0.7
    """The share of its one core an EPP replica or predictor server is planned to use."""
    scrape_intervals_s: tuple[float, ...] = (0.05, 0.2, 1.0)
    """Each replica scrapes every pod at each of these (a plan for each): under load every pod
    is busy, so on the fast tick (50 ms); and slower ones."""
    share_scrapes: bool = True
    """Synced replicas share their scrapes (``--sync-share-scrapes``, on by default): each pod is
    scraped by one replica, whose figures the others apply (one message a tick from each)."""
    own_log_entries: bool = True
    """Each replica's access logger keeps the entries of the requests it routed
    (``epp.sync.replica_header``); without, every replica reads every entry."""
    events_per_request: int = 3
    """Routed, first token, finished: each changes an endpoint's totals that go out at once."""
    answer_s: float = 5.0
    """A streamed answer's time in flight (500 tokens at ~10 ms each)."""
    predicted_share: float = 1.0
    """Requests predicted: all (none skipped for a prefix cached at ``skipWhenCachedAt``)."""
    rows_per_prediction: int = 100
    """The predicted-latency producer predicts every candidate, before the filters: every pod."""
    metering: MeteringCostSettings = field(
        default_factory=lambda: MeteringCostSettings(
            output_tokens=(500,), window_s=15.0, accuracy_requests=0, prompt_words=232, slo_every=10
        )
    )
    """The live cells: ~1k-token prompts, 500-token answers; the window leaves room for a loaded
    machine; no accuracy run (what it learns is the metering bench's question, not this one's)."""
    callout: Callout = "ext-authz"
    """How the gateway asks the EPP in the plan: the cheap callout, where the gateway is an Envoy
    the operator configures (``epp.extauthz``); the other's plan goes beside it."""
    tokenizer: TokenizerMode = "sampled"
    """The EPP's tokenizer in the plan: the model's on one prompt in 16 (``--tokenize-every``),
    what an operator at this scale sets; the others' plans go beside it."""
    request_rate: RequestRateSettings = field(
        default_factory=lambda: RequestRateSettings(
            rates=(50.0, 150.0), callouts=CALLOUTS, tokenizer_sources=("dir", "sampled", "estimate")
        )
    )
    """The live request cells (``bench.runs.request_rate``), for each callout, with the model's
    tokenizer on every prompt, on one in 16, and with counts estimated from the text: the plan
    takes the cost at the last (highest) rate, which every replica of a plan at 1,000 QPS or
    more carries or exceeds, with the plan's tokenizer; the others' plans go beside it."""
    handler_requests: int = 300
    progress_streams: int = 1_000
    progress_rounds: int = 5
    log_entries: int = 100
    log_batches: int = 50
    scrape_endpoints: int = 10
    scrape_s: float = 5.0
    sync_bookings_per_endpoint: int = 8
    sync_messages: int = 200
    predictor_requests: int = 4_000
    """Simulated requests the predictor's model is trained on (the bench's default: 16,000)."""


CALLOUTS: tuple[Callout, ...] = ("ext-proc", "ext-authz")


@dataclass(frozen=True)
class UnitCosts:
    """CPU µs per unit, on this machine."""

    request_us: float
    """A streamed request routed over ``pods`` endpoints at the highest rate measured, with the
    plan's callout: over ext_proc handed off at its first token, over ext_authz at its routing."""
    chunk_us: float
    """A response chunk read through ext_proc (streams metered in full)."""
    log_entry_us: float
    """An access-log entry for a request another replica handed off."""
    scrape_us: float
    sync_message_us: float
    """A sync message applied, apart from the endpoint totals it carries."""
    sync_total_us: float
    """An endpoint's totals applied."""
    row_us: float
    """A prediction row (both models)."""
    progress_us: float
    """A handed-off stream's decode progress moved on (once a second while it is in flight)."""
    share_apply_us: float
    """A peer's shared scrape of one endpoint applied (scrape sharing, ``bench.runs.scrape_share_cost``)."""


# ---------------------------------------------------------------- sizing


def request_cores(costs: UnitCosts, s: CapacitySettings, qps: float) -> float:
    """EPP cores the requests take, all replicas together: each handed off (at its first token
    over ext_proc, at its routing over ext_authz), its decode progress moved on once a second
    until it ends, and over ext_proc one in ``sample_every`` also read chunk by chunk."""
    chunks = costs.chunk_us * s.output_tokens / s.sample_every if s.callout == "ext-proc" else 0.0
    return qps * (costs.request_us + costs.progress_us * s.answer_s * ESTIMATE_HZ + chunks) / 1e6


ESTIMATE_HZ = 1.0
"""The EPP moves its handed-off streams' decode progress on once a second (``epp.app``)."""


def _sync_events_per_s(s: CapacitySettings, qps: float, replicas: int) -> float:
    return s.events_per_request * qps / replicas


def sync_messages_per_s(s: CapacitySettings, qps: float, replicas: int) -> float:
    """Messages one replica publishes a second: a take whenever an endpoint's totals changed (at
    most one per publish interval; the tick's and the progress estimate's go with one), and
    heartbeats."""
    if replicas == 1:
        return 0.0
    changes = _sync_events_per_s(s, qps, replicas) + 1 / _TUNING.progress_interval_s + ESTIMATE_HZ
    return min(1 / _TUNING.publish_interval_s, changes) + 1 / _TUNING.heartbeat_interval_s


def sync_totals_per_s(s: CapacitySettings, qps: float, replicas: int) -> float:
    """Endpoint totals one replica publishes a second, an upper bound: one per event of its
    requests (none coalesced within a take); at each tick, one per pod where a stream metered
    in full decodes; once a second, one per pod where a handed-off one does; but no more than
    every pod in every take."""
    if replicas == 1:
        return 0.0
    in_flight = qps / replicas * s.answer_s
    ticks = min(s.pods, in_flight / s.sample_every) / _TUNING.progress_interval_s
    estimates = min(s.pods, in_flight) * ESTIMATE_HZ
    return min(s.pods / _TUNING.publish_interval_s, _sync_events_per_s(s, qps, replicas) + ticks + estimates)


def replica_overhead(
    costs: UnitCosts, s: CapacitySettings, qps: float, replicas: int, scrape_interval_s: float
) -> dict[str, float]:
    """Cores each replica spends besides its share of the requests: scraping every
    ``scrape_interval_s`` the pods it owns (every pod without ``share_scrapes``) and applying its
    peers' scrapes of the others, applying its ``replicas - 1`` peers' sync, and, unless the
    gateway logs to each replica its own requests only (``own_log_entries``; its own entries
    are in the request's cost), reading the access-log entries of their requests."""
    peers = replicas - 1
    sync_us = sync_messages_per_s(s, qps, replicas) * costs.sync_message_us
    sync_us += sync_totals_per_s(s, qps, replicas) * costs.sync_total_us
    owned = s.pods / replicas if s.share_scrapes else s.pods
    scrape_us = owned * costs.scrape_us + (s.pods - owned) * costs.share_apply_us
    return {
        "scrapes": scrape_us / scrape_interval_s / 1e6,
        "sync": peers * sync_us / 1e6,
        "access_log": 0.0 if s.own_log_entries else qps * peers / replicas * costs.log_entry_us / 1e6,
    }


def replica_cores(
    costs: UnitCosts, s: CapacitySettings, qps: float, replicas: int, scrape_interval_s: float
) -> float:
    """The cores one of ``replicas`` replicas uses: its share of the requests and its overhead."""
    overhead = replica_overhead(costs, s, qps, replicas, scrape_interval_s)
    return request_cores(costs, s, qps) / replicas + sum(overhead.values())


def plan(
    costs: UnitCosts, s: CapacitySettings, qps: float, scrape_interval_s: float, max_replicas: int = 2_000
) -> dict[str, Any]:
    """The fewest EPP replicas, each on one core (Python: one process is about one core), whose
    cores stay within ``utilisation`` (``fits``): requests spread evenly, and each replica pays
    :func:`replica_overhead`, which grows with the replicas; and the EPP cores they use in all.
    When no count up to ``max_replicas`` fits (the overhead catches up with the requests' share),
    the count whose replicas are least loaded, and ``fits`` is False. Also the predictor servers
    (one core each, at ``utilisation``) and the NATS messages a second (all replicas' published,
    and delivered to their peers)."""
    counts = range(1, max_replicas + 1)
    fitting = [k for k in counts if replica_cores(costs, s, qps, k, scrape_interval_s) <= s.utilisation]
    replicas = (
        fitting[0]
        if fitting
        else min(counts, key=lambda k: replica_cores(costs, s, qps, k, scrape_interval_s))
    )
    requests = request_cores(costs, s, qps)
    overhead = replica_overhead(costs, s, qps, replicas, scrape_interval_s)
    rows = qps * s.predicted_share * s.rows_per_prediction
    shared = 1 / scrape_interval_s if s.share_scrapes and replicas > 1 else 0.0
    published = replicas * (sync_messages_per_s(s, qps, replicas) + shared)
    return {
        "qps": qps,
        "scrape_interval_s": scrape_interval_s,
        "fits": bool(fitting),
        "replicas": replicas,
        "replica_cores": replica_cores(costs, s, qps, replicas, scrape_interval_s),
        "epp_cores": requests + replicas * sum(overhead.values()),
        "request_cores": requests,
        "per_replica": {"requests": requests / replicas, **overhead},
        "predictor_rows_per_s": rows,
        "predictor_servers": math.ceil(rows * costs.row_us / 1e6 / s.utilisation),
        "nats_published_per_s": published,
        "nats_delivered_per_s": published * (replicas - 1),
        "llm_d_epp_cores": llm_d_epp_cores(qps, s.output_tokens),
        "llm_d_predictor_servers": LLM_D_PREDICTOR_SERVERS.get(int(qps)),
    }


def callout_plans(
    costs: UnitCosts, s: CapacitySettings, request_us: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The plan at the fastest scrape tick with each request cost measured: per callout and
    tokenizer (``{"callout", "tokenizer", "us"}``)."""
    fastest = s.scrape_intervals_s[0]
    return [
        {
            "callout": r["callout"],
            "tokenizer": r["tokenizer"],
            "request_us": r["us"],
            **plan(replace(costs, request_us=r["us"]), replace(s, callout=r["callout"]), qps, fastest),
        }
        for r in request_us
        for qps in s.qps
    ]


def llm_d_epp_cores(qps: float, output_tokens: int) -> float:
    """llm-d's EPP cores by arithmetic on its figures: ~4 ms per request plus ~31 µs per chunk."""
    return qps * (LLM_D_REQUEST_US + LLM_D_CHUNK_US * output_tokens) / 1e6


# ---------------------------------------------------------------- unit costs


def measure_streams(settings: MeteringCostSettings) -> dict[str, Any]:
    """EPP CPU µs per chunk read when metered in full, from one live stack per metering
    (``bench.runs.metering_cost``): a full stream's cost less a handed-off one's, paced alike."""
    by_mode = {mode: metering_cost.measure(mode, settings)["cells"][0] for mode in ("full", "first-token")}
    full, first = by_mode["full"], by_mode["first-token"]
    return {"cells": by_mode, "chunk_us": (full["epp_ms"] - first["epp_ms"]) * 1e3 / full["chunks"]}


def measure_pool_size_us(pods: int, requests: int) -> dict[str, float]:
    """In-process CPU µs per request (new prompts, predicted-latency) routed over 4 endpoints, as
    in the live stack, and over ``pods``."""
    return {
        str(n): handler_cpu.measure("predicted-latency", True, requests, 3, endpoints=n) for n in (4, pods)
    }


FIRST_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


def measure_progress_us(streams: int, rounds: int) -> float:
    """In-process CPU µs to move one handed-off stream's decode progress on (the EPP does it for
    every such stream once a second, ``epp.app``): ``streams`` streamed chats routed over four
    endpoints decoding at 10 ms a token, each handed off at its first token, then ``rounds``
    estimates of them all."""
    metering = MeteringSettings(mode="first-token", sample_every=10**9, calibration_streams=0)
    director = handler_cpu.make_director("predicted-latency", metering=metering)
    for i in range(4):
        director.decode_rates.observe(f"e{i}", 0.01)
    wires = [handler_cpu.streamed_chat_wire(i, FIRST_CHUNK) for i in range(streams)]

    async def hand_off() -> None:
        for wire in wires:
            await handler_cpu._send(director, wire)

    asyncio.run(hand_off())
    handed_off = director.metrics.handed_off.collect()[0].samples[0].value
    assert handed_off >= streams - 1, f"{handed_off:g} of {streams} streams handed off"
    cpu = 0.0
    for _ in range(rounds):
        time.sleep(0.05)  # five tokens on at 10 ms each: every stream has moved
        started = time.process_time()
        director.estimate_progress()
        cpu += time.process_time() - started
    return cpu / (rounds * streams) * 1e6


def access_log_batch(count: int, start: int = 0) -> bytes:
    """One message of ``count`` entries, as Envoy's gRPC access log sends a finished stream's:
    addresses, cluster, time points, the request's headers and the response's counts."""
    message = StreamAccessLogsMessage()
    message.identifier.log_name = "epp"
    for i in range(start, start + count):
        entry = message.http_logs.log_entry.add()
        common = entry.common_properties
        common.downstream_remote_address.socket_address.address = "10.1.2.3"
        common.downstream_remote_address.socket_address.port_value = 40_000 + i % 20_000
        common.upstream_remote_address.socket_address.address = f"10.0.0.{i % 100}"
        common.upstream_remote_address.socket_address.port_value = 8000
        common.upstream_cluster = "llm-pool"
        common.start_time.FromNanoseconds(1_760_000_000_000_000_000 + i * 1_000_000)
        common.time_to_last_rx_byte.FromNanoseconds(400_000)
        common.time_to_first_upstream_tx_byte.FromNanoseconds(3_000_000)
        common.time_to_first_upstream_rx_byte.FromNanoseconds(40_000_000)
        common.time_to_last_upstream_rx_byte.FromNanoseconds(5_500_000_000)
        common.time_to_last_downstream_tx_byte.FromNanoseconds(5_500_200_000)
        common.metadata.filter_metadata["llm_epp"].update({"sse_done": True})
        entry.protocol_version = HTTPAccessLogEntry.HTTP11
        request = entry.request
        request.request_method = RequestMethod.POST
        request.scheme, request.authority, request.path = "http", "gateway", "/v1/chat/completions"
        request.user_agent = "OpenAI/Python 1.99.0"
        request.request_id = f"envoy-{i}"
        request.request_headers[REQUEST_ID_HEADER] = f"{i:08x}-5f2c-4d3e-9a1b-7c6d5e4f3a2b"
        request.request_headers_bytes, request.request_body_bytes = 420, 5_800
        response = entry.response
        response.response_code.value = 200
        response.response_headers_bytes, response.response_body_bytes = 180, 500 * 130
        response.response_code_details = "via_upstream"
    return message.SerializeToString()


def measure_log_entry_us(entries: int, batches: int) -> float:
    """CPU µs per access-log entry for a request this replica does not know (another handed it
    off): the batch parsed, each entry read and handed to a director, which finds none."""
    director = handler_cpu.make_director("predicted-latency")
    wire = [access_log_batch(entries, b * entries) for b in range(batches + 1)]

    def read(data: bytes) -> None:
        for entry in StreamAccessLogsMessage.FromString(data).http_logs.log_entry:
            director.log_entry(log_entry(entry))

    read(wire[0])  # warm up: the metrics' first labels
    started = time.thread_time()
    for data in wire[1:]:
        read(data)
    return (time.thread_time() - started) / (entries * batches) * 1e6


class _BusyEngine(BaseHTTPRequestHandler):
    """A busy engine's ``/metrics``: the real scrape, with the running count changed each time
    (so the scraper parses every one); and a ``/v1/models``."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the scraper's aiohttp session expects
    LINE = 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0'
    MODELS = b'{"object": "list", "data": [{"id": "tiny", "max_model_len": 4096}]}'
    served = 0

    def do_GET(self) -> None:
        _BusyEngine.served += 1
        body = self.MODELS
        if self.path == "/metrics":
            body = VLLM_SCRAPE.read_text().replace(self.LINE, f"{self.LINE[:-4]} {self.served}.0").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the scraper hanging up when it is done is no error


def _serve_busy_engine(ports: multiprocessing.Queue) -> None:
    server = _QuietServer(("127.0.0.1", 0), _BusyEngine)
    ports.put(server.server_address[1])
    server.serve_forever()


@contextmanager
def _busy_engine() -> Iterator[int]:
    """A :class:`_BusyEngine` server in a process of its own (its work is not the scraper's);
    yields its port."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    process = context.Process(target=_serve_busy_engine, args=(ports,), daemon=True)
    process.start()
    try:
        yield ports.get(timeout=60)
    finally:
        process.terminate()
        process.join()


class _CountingScraper(MetricsScraper):
    """The EPP's scraper, counting its scrapes."""

    scrapes = 0

    async def scrape_once(self, name: str, client: KeepAliveHttp) -> None:
        self.scrapes += 1
        await super().scrape_once(name, client)


async def _scrape_for(endpoints: int, port: int, seconds: float) -> tuple[float, int]:
    """The scraper polling ``endpoints`` endpoints (all at ``port``) for ``seconds`` on the fast
    tick: this thread's CPU seconds and the scrapes, after a second of warm-up."""
    store = EndpointStore()
    store.replace([Endpoint(f"e{i}", "127.0.0.1", port) for i in range(endpoints)])
    scraper = _CountingScraper(store, time.monotonic, interval=0.05, idle_interval=0.05)
    scraper.start()
    try:
        await asyncio.sleep(1.0)
        scrapes, started = scraper.scrapes, time.thread_time()
        await asyncio.sleep(seconds)
        return time.thread_time() - started, scraper.scrapes - scrapes
    finally:
        await scraper.close()


def measure_scrape_us(endpoints: int, seconds: float) -> dict[str, float]:
    """The scraping thread's CPU µs per scrape of a busy engine's real vLLM ``/metrics``."""
    with _busy_engine() as port:
        cpu_s, scrapes = asyncio.run(_scrape_for(endpoints, port, seconds))
    return {"scrape_us": cpu_s / scrapes * 1e6, "scrapes": scrapes}


def _sync_messages(pods: int, bookings: int, messages: int, endpoints_each: int) -> list[bytes]:
    """A peer's ``messages`` sync messages after its first, each the totals of ``endpoints_each``
    endpoints (their decode progress moved), ``bookings`` requests on every one of ``pods``."""
    clock = [0.0]
    peer = ReplicaSyncState("peer", SyncTargets(), clock=lambda: clock[0], incarnation=1)
    names = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(pods)]
    keys = range(pods * bookings)
    for key in keys:
        peer.routed(
            key,
            names[key % pods],
            kv_tokens=1_000,
            uncached_tokens=500,
            expected_output=500,
            tpot_slo_ms=50.0 if key % 10 == 0 else None,
            prompt_tail=key * 7_919,
        )
        peer.first_token(key)
    wire = peer.take_messages()
    for tick in range(messages):
        for key in range(endpoints_each):
            peer.progress(key, tick + 2)
        peer.flush()
        wire += peer.take_messages()
    return wire


def _apply_us(wire: list[bytes]) -> float:
    """CPU µs per message for a fresh replica to ``receive`` all but the first of ``wire``."""
    receiver = ReplicaSyncState(
        "receiver", SyncTargets(token_load=PeerTotals(), tpot_slos={}), clock=time.monotonic, incarnation=1
    )
    receiver.receive(wire[0])
    started = time.thread_time()
    for data in wire[1:]:
        assert receiver.receive(data) is not None
    return (time.thread_time() - started) / (len(wire) - 1) * 1e6


def measure_sync_us(pods: int, bookings: int, messages: int) -> dict[str, float]:
    """CPU µs to apply a peer's message of one endpoint's totals and one of all ``pods``'; the
    second less the first, per endpoint, is a total's; the first less that, a message's."""
    one = _apply_us(_sync_messages(pods, bookings, messages, 1))
    every = _apply_us(_sync_messages(pods, bookings, messages, pods))
    total = (every - one) / (pods - 1)
    return {"one_endpoint_us": one, "every_endpoint_us": every, "total_us": total, "message_us": one - total}


def measure_row_us(requests: int) -> dict[str, float]:
    """Predictor CPU µs per row of a 100-row binary bulk call, in process, on a model of the
    trainer's default shape trained on ``requests`` simulated requests."""
    settings = predictor_bench.PredictorBenchSettings(requests=requests)
    rate = settings.mean_rates_per_engine[0]
    with Progress(transient=True) as progress, tempfile.TemporaryDirectory() as scratch:
        records = predictor_bench.simulate_traffic(settings, rate, progress)
        model_dir = Path(scratch) / "model"
        predictor_bench.measure_error(records, model_dir, "log", settings)
        rows = [r.features for r in records[-settings.rows_per_call :]]
        call_us = predictor_bench.measure_call_cost(model_dir, rows, repeats=200)[
            "whole_binary_call_in_process_us"
        ]
    return {"call_us": call_us, "row_us": call_us / settings.rows_per_call}


def measure(s: CapacitySettings) -> tuple[UnitCosts, dict[str, Any]]:
    """Every unit cost on this machine, and the measurements they came from."""
    rates = request_rate.measure(s.request_rate)
    streams = measure_streams(s.metering)
    pool = measure_pool_size_us(s.pods, s.handler_requests)
    scrape = measure_scrape_us(s.scrape_endpoints, s.scrape_s)
    sync = measure_sync_us(s.pods, s.sync_bookings_per_endpoint, s.sync_messages)
    predictor = measure_row_us(s.predictor_requests)
    share = scrape_share_cost.measure_share_apply_us(s.pods, s.sync_messages)
    top, pool_us = max(s.request_rate.rates), pool[str(s.pods)] - pool["4"]
    request_us = [
        {"callout": c["callout"], "tokenizer": c["tokenizer"], "us": c["epp_us"] + pool_us}
        for c in rates["cells"]
        if c["rate"] == top
    ]
    costs = UnitCosts(
        request_us=next(
            r["us"] for r in request_us if r["callout"] == s.callout and r["tokenizer"] == s.tokenizer
        ),
        chunk_us=streams["chunk_us"],
        log_entry_us=measure_log_entry_us(s.log_entries, s.log_batches),
        scrape_us=scrape["scrape_us"],
        sync_message_us=sync["message_us"],
        sync_total_us=sync["total_us"],
        row_us=predictor["row_us"],
        progress_us=measure_progress_us(s.progress_streams, s.progress_rounds),
        share_apply_us=share["figure_us"],
    )
    sources = {
        "request_us": request_us,
        "rates": rates,
        "streams": streams,
        "handler_us_by_endpoints": pool,
        "scrape": scrape,
        "sync": sync,
        "share_apply": share,
    }
    return costs, {**sources, "predictor": predictor}


# ---------------------------------------------------------------- report


def _unit_rows(costs: UnitCosts, s: CapacitySettings) -> list[list[str]]:
    return [
        [
            f"request (ISL ~{s.input_tokens:,}, OSL {s.output_tokens}, {s.callout}, tokenizer: "
            f"{TOKENIZER_LABELS[s.tokenizer]}, {s.pods} pods)",
            f"{costs.request_us:,.0f}",
            f"~{LLM_D_REQUEST_US:,.0f}",
        ],
        ["metered chunk (full metering)", f"{costs.chunk_us:,.1f}", "24–31"],
        ["access-log entry (another replica's request)", f"{costs.log_entry_us:,.1f}", "–"],
        ["scrape (busy engine, real vLLM body)", f"{costs.scrape_us:,.0f}", f"~{LLM_D_SCRAPE_US:,.0f}"],
        ["sync message applied (besides its totals)", f"{costs.sync_message_us:,.1f}", "–"],
        ["sync endpoint total applied", f"{costs.sync_total_us:,.2f}", "–"],
        [
            f"sync tick applied (one peer, {s.pods} pods' totals)",
            f"{costs.sync_message_us + s.pods * costs.sync_total_us:,.0f}",
            "–",
        ],
        ["prediction row (both models)", f"{costs.row_us:,.2f}", "–"],
        ["decode progress of a handed-off stream moved on (once a second)", f"{costs.progress_us:,.2f}", "–"],
        ["shared scrape applied (one endpoint's, from its owner)", f"{costs.share_apply_us:,.2f}", "–"],
    ]


def _plan_rows(plans: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for p in plans:
        part = p["per_replica"]
        llm_d_servers = p["llm_d_predictor_servers"]
        replicas = (
            f"{p['replicas']}"
            if p["fits"]
            else f"none fits (best: {p['replicas']} at {p['replica_cores']:.2f})"
        )
        rows.append(
            [
                f"{p['qps']:,}",
                f"{p['scrape_interval_s'] * 1e3:g} ms",
                f"{p['request_cores']:.1f}",
                f"{p['epp_cores']:.1f}" if p["fits"] else "–",
                replicas,
                " / ".join(f"{part[k]:.2f}" for k in ("requests", "scrapes", "access_log", "sync")),
                f"{part['sync'] * 1e3:.0f} ms/s",
                f"{p['nats_published_per_s']:,.0f} ({p['nats_delivered_per_s']:,.0f})",
                f"{p['predictor_servers']}",
                f"~{p['llm_d_epp_cores']:.0f}",
                "–" if llm_d_servers is None else str(llm_d_servers),
            ]
        )
    return rows


def _markdown(data: dict[str, Any]) -> str:
    s, costs, m = data["settings"], UnitCosts(**data["unit_costs"]), data["measured"]
    cells = m["streams"]["cells"]
    by_endpoints = m["handler_us_by_endpoints"]
    first, full = cells["first-token"], cells["full"]
    settings = CapacitySettings(**{**s, "metering": MeteringCostSettings(**s["metering"])})
    return "\n\n".join(
        [
            "# Capacity plan, measured",
            f"{s['pods']} pods, ISL ~{s['input_tokens']:,} / OSL {s['output_tokens']} streamed, one "
            f"request in {s['metering']['slo_every']} with SLO headers; the {s['callout']} callout"
            + (
                f" with first-token metering, one stream in {s['sample_every']:,} read whole"
                if s["callout"] == "ext-proc"
                else ", every request finished from the access log"
            )
            + ". Unit costs measured on this machine "
            f"({data['machine']['cpus']} CPUs, load average {data['load_average']}); llm-d's beside them.",
            markdown_table(["unit", "EPP µs (ours)", "llm-d µs"], _unit_rows(costs, settings)),
            "Live stack, open loop (`bench.runs.request_rate`, ~1k-token prompts, streamed answers handed "
            "off at the first token over ext_proc, at the routing over ext_authz): "
            + "; ".join(
                f"{c['callout']} (tokenizer: {TOKENIZER_LABELS[c['tokenizer']]}) at {c['rate']:g} "
                f"requests/s (achieved {c['achieved_rate']:.0f}): "
                f"{c['epp_us']:,.0f} µs of "
                f"EPP CPU and {c['envoy_us']:,.0f} of Envoy's a request"
                for c in m["rates"]["cells"]
            )
            + f". The plan takes {s['callout']}'s at the highest rate. Paced slowly "
            f"(`bench.runs.metering_cost`, {s['metering']['requests']} "
            f"answers over {s['metering']['arrival_span_s']:g} s), a stream handed off at its first token "
            f"cost {first['epp_ms']:.2f} ms and one read whole {full['epp_ms']:.1f} ms "
            f"({full['chunks']:.0f} chunks): the chunk's cost. Routing over {s['pods']} endpoints "
            f"instead of 4 adds {by_endpoints[str(s['pods'])] - by_endpoints['4']:.0f} µs (in process).",
            markdown_table(
                [
                    "QPS",
                    "scrape tick",
                    "EPP cores: requests",
                    "EPP cores in all",
                    f"EPP replicas (≤ {s['utilisation']:.0%} of a core each)",
                    "per replica: requests / scrapes / access log / sync (cores)",
                    "sync CPU per replica",
                    "NATS msgs/s published (delivered)",
                    "predictor servers",
                    "llm-d EPP cores",
                    "llm-d predictor servers",
                ],
                _plan_rows(data["plans"]),
            ),
            "EPP cores: requests are the requests' own CPU; in all, with each replica's scrapes, "
            "access-log entries and sync. none fits: no replica count keeps each within its share "
            "of a core (the figures after it are then those of the least loaded count). Assumptions: "
            "every pod busy, so on the fast tick; "
            + (
                "scrapes shared: each pod scraped by one replica, its figures applied by the others; "
                if s["share_scrapes"]
                else "every pod scraped by every replica; "
            )
            + f"{s['rows_per_prediction']} prediction rows for {s['predicted_share']:.0%} of requests (the "
            "predicted-latency producer predicts every pod before its filters, unless the prefix is "
            "cached at `skipWhenCachedAt`); sync totals counted with no coalescing within a take "
            f"(an upper bound), streams in flight for ~{s['answer_s']:g} s; NATS: each replica's "
            "takes (at most one per 5 ms), heartbeats and shared scrapes (one a tick), delivered to "
            "every peer. llm-d's EPP "
            "cores: ~4 ms per request + ~31 µs per chunk.",
            f"Each callout and tokenizer at the {s['scrape_intervals_s'][0] * 1e3:g} ms tick (the plan "
            f"above is {s['callout']}'s, tokenizer: {TOKENIZER_LABELS[s['tokenizer']]}; ext_proc's "
            "requests also read one "
            f"stream in {s['sample_every']:,} chunk by chunk; on 1 prompt in {SAMPLE_EVERY}: "
            f"`--tokenize-every {SAMPLE_EVERY}`; estimated counts: `--tokenizer-source estimate`; "
            "docs/tokenizer.md):",
            markdown_table(
                ["callout", "tokenizer", "EPP µs / request", "QPS", "EPP cores in all", "EPP replicas"],
                [
                    [
                        p["callout"],
                        TOKENIZER_LABELS[p["tokenizer"]],
                        f"{p['request_us']:,.0f}",
                        f"{p['qps']:,}",
                        f"{p['epp_cores']:.1f}" if p["fits"] else "none fits",
                        str(p["replicas"]),
                    ]
                    for p in data["callout_plans"]
                ],
            ),
            markdown_table(
                ["llm-d figure", "value", "source"], [[p.figure, p.value, p.source] for p in LLM_D]
            ),
            f"![capacity]({data['plot']})",
        ]
    )


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    """EPP cores against QPS: the requests' own, ours in all at each scrape tick (where a replica
    count fits), and llm-d's arithmetic."""
    figure, axis = plt.subplots(figsize=(7, 4))
    s = data["settings"]
    first = [p for p in data["plans"] if p["scrape_interval_s"] == s["scrape_intervals_s"][0]]
    axis.plot(
        [p["qps"] for p in first],
        [p["request_cores"] for p in first],
        "k--",
        label="llm-epp, the requests alone",
    )
    for interval in s["scrape_intervals_s"]:
        plans = [p for p in data["plans"] if p["scrape_interval_s"] == interval and p["fits"]]
        axis.plot(
            [p["qps"] for p in plans],
            [p["epp_cores"] for p in plans],
            marker="o",
            label=f"llm-epp in all, scraped every {interval * 1e3:g} ms (where a replica count fits)",
        )
    axis.plot(s["qps"], [llm_d_epp_cores(q, s["output_tokens"]) for q in s["qps"]], marker="s", label="llm-d")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("QPS")
    axis.set_ylabel("EPP CPU cores")
    axis.set_title(f"EPP cores, {s['pods']} pods, OSL {s['output_tokens']} streamed")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=7)
    return save_figure(figure, out_dir, "capacity.png")


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(out_dir: Path, settings: CapacitySettings | None = None) -> dict[str, Any]:
    s = settings or CapacitySettings()
    load_before = _load_average()
    costs, measured = measure(s)
    data: dict[str, Any] = {
        "machine": machine(),
        "load_average": f"{load_before} at the start, {_load_average()} at the end",
        "settings": asdict(s),
        "unit_costs": asdict(costs),
        "measured": measured,
        "plans": [plan(costs, s, qps, interval) for interval in s.scrape_intervals_s for qps in s.qps],
        "callout_plans": callout_plans(costs, s, measured["request_us"]),
        "llm_d": [asdict(p) for p in LLM_D],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    data["plot"] = _plot(data, out_dir)
    write_results(out_dir, "capacity", data, _markdown(data))
    return data
