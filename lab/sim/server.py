"""A simulated vLLM 0.32 server: OpenAI API, /metrics and admin routes over a modelled engine.

Each replica is one engine with its own FastAPI app, Prometheus registry and port; ``--replicas
N`` runs N of them on consecutive ports in one process and one event loop, which is how many
endpoints are run cheaply on a small machine::

    llm-epp-sim --port 8100 --replicas 4 --profile default

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /reset_prefix_cache;
GET /v1/models, /health, /version, /metrics, /kv_event_sources.

Admin, from loopback only (403 from elsewhere): ``POST /admin/engine-speed`` with
``{"profile": name or path (default: the server's), "slowdown": factor (default 1)}`` makes
every later engine step cost that profile's step time × ``slowdown`` (the engine changes speed
mid-run, e.g. to test the EPP's drift detection); it answers the profile and slowdown now in
force. ``POST /admin/metrics-delay`` with ``{"seconds": s}`` makes every later ``/metrics``
answer ``s`` late while the engine serves on as before: vLLM's API server under heavy load, whose
event loop is busy streaming tokens.

KV events: ``--kv-events-config`` takes vLLM's JSON (``sim.kv_events``), so one launcher serves
both. Replica ``i`` of ``--replicas N`` publishes on its own endpoints, derived as vLLM derives a
data-parallel rank's: a tcp port plus ``i``, an ipc path with ``_dp{i}`` appended (replica 0 uses
the endpoints as given). ``/kv_event_sources`` reports each replica's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
import zmq
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from epp.tokenizer.model import ModelTokenizer
from sim.driver import EngineDriver
from sim.engine import Engine, EngineConfigError, Profile, ProfileError, RequestOutput, load_profile
from sim.engine.pool import load_variant
from sim.host_cpu import HostCpu
from sim.kv_events import KVEventPublisher, KVEventsConfig
from sim.metrics import EngineMetricsExporter
from sim.models import TINY_MODEL_DIR
from sim.openai_api import (
    VLLM_VERSION,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    error_response,
    models_response,
    validation_error_response,
)
from sim.openai_serving import ClientDisconnectedError, OpenAIServing, ServedModel

logger = logging.getLogger("sim.server")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1"})


class EngineSpeed(BaseModel):
    """The body of ``POST /admin/engine-speed``."""

    model_config = ConfigDict(extra="forbid")

    profile: str | None = None
    slowdown: float = Field(1.0, gt=0.0, le=1000.0)


class MetricsDelay(BaseModel):
    """The body of ``POST /admin/metrics-delay``."""

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(ge=0.0, le=600.0)


ENGINE_OVERRIDES = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "max_model_len")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What one simulated server serves and how its engine is sized.

    ``engine_overrides`` replaces fields of the profile's engine limits (any ``EngineConfig``
    field, e.g. ``{"num_gpu_blocks": 64}``). ``kv_events`` is vLLM's ``--kv-events-config``, as
    given to the whole server (``KVEventsConfig.for_replica`` derives each replica's). ``cpu`` is
    the CPU whose vLLM CPU build the reported cache config follows (None: this machine's).
    """

    model_dir: Path = TINY_MODEL_DIR
    served_model_name: str = "tiny"
    model_root: str | None = None
    """What ``/v1/models`` reports as the model's ``root``: what ``vllm serve`` was given, a local
    path or a Hugging Face repository id (None: ``model_dir``, a model served from a path)."""
    profile: str = "default"
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    histogram_refresh_s: float = 1.0
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    cpu: HostCpu | None = None


class SimulatedVllm:
    """One simulated vLLM server: its engine, the driver stepping it, its metrics, its KV-event
    publisher (when enabled; its sockets are bound here) and its app.

    ``index`` is the replica's place in a multi-replica server; it picks the KV-event endpoints.
    """

    def __init__(self, settings: ServerSettings, model: ServedModel | None = None, index: int = 0) -> None:
        self.settings = settings
        self.profile: Profile = load_variant(settings.profile)
        overrides = dict(settings.engine_overrides)
        kv_events = settings.kv_events.for_replica(index)
        if kv_events.publishes:
            overrides["enable_kv_events"] = True
        config = dataclasses.replace(self.profile.engine, **overrides)
        self.model = model or load_served_model(settings)
        self.engine = Engine(config, self.profile.cost, self.model.output_vocab)
        self.metrics = EngineMetricsExporter(
            self.engine, self.model.name, histogram_refresh_s=settings.histogram_refresh_s, cpu=settings.cpu
        )
        self.kv_events = KVEventPublisher(kv_events) if kv_events.publishes else None
        self.driver = EngineDriver(
            self.engine, on_step=self._on_step, on_step_lag=self.metrics.record_step_lag
        )
        self.serving = OpenAIServing(self.model, self.driver, self.profile.frontend)
        self.metrics_delay_s = 0.0
        self.app = _create_app(self)

    def _on_step(self, outputs: list[RequestOutput]) -> None:
        self.metrics.record_step(outputs)
        if self.kv_events is not None:
            # One batch per step, with whatever happened since the last one: as in vLLM, an
            # AllBlocksCleared from /reset_prefix_cache goes out with the next step.
            self.kv_events.publish(self.engine.drain_kv_events())


def load_served_model(settings: ServerSettings) -> ServedModel:
    return ServedModel(
        ModelTokenizer(settings.model_dir),
        settings.served_model_name,
        settings.model_root or str(settings.model_dir),
    )


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app of a new replica; its SimulatedVllm is ``app.state.replica``."""
    return SimulatedVllm(settings or ServerSettings()).app


def _from_loopback(request: Request) -> bool:
    return request.client is not None and request.client.host in LOOPBACK_HOSTS


def _admin_refused() -> JSONResponse:
    return error_response(403, "PermissionDenied", "admin routes answer loopback clients only", None)


def _create_app(replica: SimulatedVllm) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        publisher = replica.kv_events
        replay = asyncio.create_task(publisher.serve_replay()) if publisher is not None else None
        yield
        await replica.driver.stop()
        if publisher is not None and replay is not None:
            replay.cancel()
            await asyncio.gather(replay, return_exceptions=True)
            publisher.close()

    app = FastAPI(title="llm-epp simulated vLLM", version=VLLM_VERSION, lifespan=lifespan, openapi_url=None)
    app.state.replica = replica
    serving = replica.serving
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnectedError)
    async def on_client_gone(request: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, "InternalServerError", "Internal server error", None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.tokenize(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(
            replica.model.name, replica.model.root, replica.engine.config.max_model_len, started
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VLLM_VERSION}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": replica.engine.reset_prefix_cache()}

    @app.get("/metrics")
    async def metrics() -> Response:
        if replica.metrics_delay_s:
            await asyncio.sleep(replica.metrics_delay_s)
        return Response(replica.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/engine-speed")
    async def engine_speed(body: EngineSpeed, raw: Request) -> JSONResponse:
        if not _from_loopback(raw):
            return _admin_refused()
        try:
            profile = load_profile(body.profile) if body.profile else replica.profile
        except ProfileError as exc:
            return error_response(400, "BadRequestError", str(exc), "profile")
        replica.engine.cost_model = profile.cost.scaled(body.slowdown)
        logger.info("engine steps now cost %s x %.3g", profile.name, body.slowdown)
        return JSONResponse({"profile": profile.name, "slowdown": body.slowdown})

    @app.post("/admin/metrics-delay")
    async def metrics_delay(body: MetricsDelay, raw: Request) -> JSONResponse:
        if not _from_loopback(raw):
            return _admin_refused()
        replica.metrics_delay_s = body.seconds
        logger.info("/metrics now answers %.3g s late", body.seconds)
        return JSONResponse({"seconds": body.seconds})

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:
        """The publisher's config per data-parallel rank (always rank 0 here), {} when disabled."""
        publisher = replica.kv_events
        return {"0": publisher.config.model_dump()} if publisher is not None else {}

    return app


# ---------------------------------------------------------------- command line


class ReplicaServer(uvicorn.Server):
    """A uvicorn server that installs no signal handlers: ``serve_replicas`` (or a test) stops it
    by setting ``should_exit``, so several can share one process."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def build_replicas(settings: ServerSettings, count: int) -> list[SimulatedVllm]:
    """``count`` independent replicas sharing one loaded tokenizer."""
    model = load_served_model(settings)
    return [SimulatedVllm(settings, model, index) for index in range(count)]


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """Bind ``count`` consecutive ports up front, so a port in use is a clear error, not a trace."""
    sockets: list[socket.socket] = []
    try:
        for index in range(count):
            family, kind, proto, _, address = socket.getaddrinfo(host, port + index, type=socket.SOCK_STREAM)[
                0
            ]
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port + len(sockets) - 1}: {exc.strerror or exc}") from None
    return sockets


async def serve_replicas(
    replicas: Sequence[SimulatedVllm], sockets: Sequence[socket.socket], log_level: str = "info"
) -> None:
    """Serve ``replicas[i]`` on ``sockets[i]`` until SIGINT or SIGTERM."""
    servers = [
        ReplicaServer(
            uvicorn.Config(replica.app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2)
        )
        for replica in replicas
    ]
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        for server in servers:
            server.should_exit = True
        # Ending the engines ends open streams now, instead of at the graceful-shutdown timeout.
        stopping.extend(asyncio.create_task(replica.driver.stop()) for replica in replicas)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    first = replicas[0]
    logger.info(
        "serving %d simulated replica(s) of %r on %s; profile %s; %s",
        len(replicas),
        first.model.name,
        ", ".join(str(sock.getsockname()[:2]) for sock in sockets),
        first.profile.name,
        first.engine.config,
    )
    await asyncio.gather(
        *(server.serve(sockets=[sock]) for server, sock in zip(servers, sockets, strict=True))
    )
    await asyncio.gather(*stopping)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-epp-sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="port of the first replica")
    parser.add_argument("--replicas", type=int, default=1, help="engines to run, on consecutive ports")
    parser.add_argument("--model-dir", type=Path, default=TINY_MODEL_DIR, help="tokenizer + chat template")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument(
        "--model-root",
        help="the model's root in /v1/models, as vLLM reports what it serves: a Hugging Face repository "
        "id to stand for a model from the Hub (default: --model-dir)",
    )
    parser.add_argument(
        "--profile",
        default="default",
        help="shipped profile name or path to a profile YAML, with any +KEY=VALUE (sim.engine.pool)",
    )
    for name in ENGINE_OVERRIDES:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the profile"
        )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="(default: on)"
    )
    parser.add_argument(
        "--kv-events-config",
        type=parse_kv_events_config,
        default=KVEventsConfig(),
        metavar="JSON",
        help="vLLM's KV-events config, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'; '
        "replica i publishes on the endpoint's port + i (tcp) or path + _dp{i} (ipc)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return parser


def parse_kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'JSON'}: {error['msg']}" for error in exc.errors()
        )
        raise argparse.ArgumentTypeError(f"invalid KV events config: {problems}") from None


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    overrides: dict[str, Any] = {name: getattr(args, name) for name in ENGINE_OVERRIDES}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    overrides["enable_prefix_caching"] = args.enable_prefix_caching
    return ServerSettings(
        model_dir=args.model_dir,
        served_model_name=args.served_model_name,
        model_root=args.model_root,
        profile=args.profile,
        engine_overrides=overrides,
        kv_events=args.kv_events_config,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        replicas = build_replicas(settings_from_args(args), args.replicas)
    except (ProfileError, EngineConfigError, TypeError) as exc:
        parser.error(str(exc))
    except zmq.ZMQError as exc:
        parser.error(f"cannot open the KV events endpoint: {exc}")
    except Exception as exc:  # the tokenizer library raises its own exception types
        parser.error(f"cannot load the model from {args.model_dir}: {exc}")
    try:
        sockets = bind_sockets(args.host, args.port, args.replicas)
    except OSError as exc:
        parser.error(str(exc))
    asyncio.run(serve_replicas(replicas, sockets, args.log_level))


if __name__ == "__main__":
    main()
