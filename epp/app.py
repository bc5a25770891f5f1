"""Assembles and runs the EPP process: data layer, scheduling pipeline, gRPC and metrics servers."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubernetes_asyncio.client import ApiClient
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

import epp.plugin_types  # noqa: F401  (registers every plugin type)
from epp.configs import config_path
from epp.datalayer.endpoints import EndpointStore
from epp.datalayer.kv_events import KVEventsSubscriber
from epp.datalayer.metrics import KVEventMetrics, PoolMetrics
from epp.datalayer.objectives import ObjectivePriorities
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.static_file import StaticFileSource
from epp.extauthz import server as ext_authz_server
from epp.extauthz.check import ExtAuthzCheck
from epp.extproc.access_log import AccessLogReceiver
from epp.extproc.access_log import add_to_server as add_access_log_to_server
from epp.extproc.envoy_contract import EXT_PROC_HEALTH_SERVICE as EXT_PROC_SERVICE
from epp.extproc.gate import DebugAccess, HeaderLimits, RequestGate
from epp.extproc.server import ExternalProcessor, add_to_server
from epp.flowcontrol.config import build_flow_control
from epp.flowcontrol.gate import FlowGate
from epp.flowcontrol.metrics import FlowMetrics
from epp.k8s.client import api_client, default_identity, default_namespace
from epp.k8s.leader import LeaseElector, LeaseSettings
from epp.k8s.source import ApiGroupVersion, KubernetesSource, PoolWatch
from epp.kvcache.precise_index import PreciseIndex
from epp.latency.client import PredictorClient, PredictorClientSettings
from epp.latency.metrics import DriftCollector, PredictionMetrics
from epp.latency.report import PredictionReport
from epp.metrics import ModelLabels, RequestMetrics, TokenizerCacheCollector
from epp.observability.decision import DecisionLog
from epp.observability.live import LiveData
from epp.observability.recent import RecentDecisions
from epp.observability.server import start_metrics_server
from epp.observability.tracing import RequestTracer, otlp_tracer_provider
from epp.pipeline_metrics import export_producer_failures
from epp.plugins.endpoint_speed import find_endpoint_speeds
from epp.plugins.predicted_latency import find_predicted_latency
from epp.plugins.token_load import find_token_load
from epp.requestcontrol.completion_log import MeteringSettings
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RequestLifecycle
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext, ReadsEngineTokenIds
from epp.scheduling.observers import LifecycleObserver
from epp.settings import TOKENIZER_HELP, EppSettings
from epp.sync.hook import attach_replica_sync, sync_targets
from epp.sync.messages import Capability
from epp.sync.metrics import SyncMetrics
from epp.sync.nats_auth import connect_options
from epp.sync.nats_transport import NatsSyncTransport, default_replica_id
from epp.sync.replica_header import ReplicaHeader
from epp.sync.scrape_share import STALE_AFTER_TICKS, ScrapeShare
from epp.sync.state import ReplicaSyncState, SyncTuning
from epp.tls import server_credentials
from epp.tokenizer.auto import AutoTokenizer, TokenizerMetrics, download_from_hub
from epp.tokenizer.estimated import EstimatedTokenizer
from epp.tokenizer.model import TOKENIZER_FILES, ModelTokenizer, PromptTokenizer
from epp.tokenizer.sampling import Calibrated, CalibrationCollector, SampledTokenizer
from wire.auth import read_token

log = logging.getLogger(__name__)
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
READINESS_SERVICES = ("readiness", EXT_PROC_SERVICE)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]


def load_tokenizer(model_dir: Path, cache_bytes: int = 0, verify_cache: bool = False) -> ModelTokenizer:
    """The served model's tokenizer from ``model_dir`` (with a cache of recent prompts' ids, see
    ``ModelTokenizer``); :class:`FileNotFoundError` naming the missing files and how to provide
    them, so the EPP refuses to start without one."""
    missing = [name for name in TOKENIZER_FILES if not (model_dir / name).is_file()]
    if missing:
        files = " or ".join(missing)
        raise FileNotFoundError(f"--tokenizer-dir {model_dir} has no {files}; give it {TOKENIZER_HELP}")
    return ModelTokenizer(model_dir, cache_bytes, verify_cache)


def request_gate(settings: EppSettings) -> RequestGate:
    """The header checks of ``settings`` (``epp.extproc.gate``)."""
    return RequestGate(
        HeaderLimits(settings.max_request_headers, settings.max_request_headers_kb),
        DebugAccess.from_settings(settings.decision_trace_token_file, settings.decision_trace_from),
    )


class EppApp:
    """One EPP instance. ``start()`` binds every port; ``stop()`` releases them."""

    def __init__(self, settings: EppSettings) -> None:
        self.settings = settings
        self.clock = time.monotonic
        self.store = EndpointStore()
        self.objective_priorities = ObjectivePriorities()
        self.source: StaticFileSource | None = None
        if settings.endpoints_file is not None and settings.endpoint_source == "file":
            self.source = StaticFileSource(settings.endpoints_file, self.store, settings.endpoints_poll_s)
        self.k8s_source: KubernetesSource | None = None
        self.elector: LeaseElector | None = None
        self.registry = CollectorRegistry()
        labels = ModelLabels()
        self.pool_metrics = PoolMetrics(self.registry, settings.pool_name, self.store, self.clock)
        prediction_metrics = PredictionMetrics(self.registry, labels)
        rng = random.Random(settings.seed)
        self.predictor: PredictorClient | None = None
        if settings.predictor_url:
            token_file = settings.trainer_token_file
            client_settings = PredictorClientSettings(
                settings.predictor_url,
                settings.trainer_url,
                timeout_s=settings.prediction_timeout_ms / 1e3,
                coalesce_window_s=settings.prediction_coalesce_ms / 1e3,
                trainer_token=read_token(token_file) if token_file else None,
            )
            self.predictor = PredictorClient(client_settings, self.clock, prediction_metrics)
        config = EndpointPickerConfig.from_file(config_path(settings.config))
        self.kv_index = PreciseIndex()
        self.pool_metrics.track_kv_index(self.kv_index)
        context = PluginContext(
            clock=self.clock, rng=rng, latency_predictor=self.predictor, kv_index=self.kv_index
        )
        self.pipeline = build_pipeline(config, context)
        if settings.tokenize_every > 1:
            for name, plugin in self.pipeline.plugins.items():
                if isinstance(plugin, ReadsEngineTokenIds):
                    raise ConfigError(
                        f"--tokenize-every {settings.tokenize_every} estimates most prompts' token ids, "
                        f"and plugin {name!r} needs the engine's: {plugin.engine_token_ids_needed()}; "
                        "use --tokenize-every 1 with this config"
                    )
        self.scraper = MetricsScraper(
            self.store,
            self.clock,
            settings.scrape_interval_s,
            settings.scrape_timeout_s,
            idle_interval=settings.idle_scrape_interval_s,
        )
        self.flow_gate = self._flow_gate(config, context)
        export_producer_failures(self.registry, self.pipeline)
        observers: list[LifecycleObserver] = [PredictionReport(prediction_metrics), DecisionLog()]
        self.tracer_provider: TracerProvider | None = None
        if settings.otlp_traces_endpoint:
            self.tracer_provider = otlp_tracer_provider(
                settings.otlp_traces_endpoint, settings.otlp_service_name
            )
            observers.append(RequestTracer(self.tracer_provider, self.clock))
        self.replica_id = settings.replica_id or default_replica_id()
        if settings.sync_nats_url:  # the gateway logs to each replica the requests it routed
            observers.append(ReplicaHeader(self.replica_id))
        self.lifecycle = RequestLifecycle(self.pipeline, observers)
        if (predicted_latency := find_predicted_latency(self.pipeline.plugins.values())) is not None:
            self.registry.register(DriftCollector(predicted_latency.drift))
        token_load = find_token_load(self.pipeline.plugins.values())
        self.sync: NatsSyncTransport | None = None
        if settings.sync_nats_url:
            self.sync = self._replica_sync()
            if self.flow_gate is not None and token_load is not None:  # count the whole pool's tokens
                self.flow_gate.share_load(self.sync.state)
            elif self.flow_gate is not None:
                log.warning(
                    "flow control counts only this replica's own load: peers' bookings need a "
                    "token-load-producer in the EndpointPickerConfig"
                )
        if token_load is not None:
            self.pool_metrics.export_token_load(token_load.tracker, token_load.peers if self.sync else None)
        if (speeds := find_endpoint_speeds(self.pipeline.plugins.values())) is not None:
            self.pool_metrics.export_endpoint_speeds(speeds)
        # The live page's recent decisions.
        self.recent = RecentDecisions()
        self.lifecycle.add_observer(self.recent)
        # An idle endpoint's slow scrape tick turns fast as soon as a request is routed there.
        self.lifecycle.add_observer(self.scraper)
        trackers = (
            [] if token_load is None else [token_load.tracker, *([token_load.peers] if self.sync else [])]
        )
        self.live = LiveData(
            settings.pool_name, self.pipeline.profile.name, self.store, self.recent, self.clock, trackers
        )
        self.tokenizer_metrics = TokenizerMetrics(self.registry, settings.pool_name)
        self._cache_collector: TokenizerCacheCollector | None = None
        tokenizer: PromptTokenizer = EstimatedTokenizer()
        self.auto_tokenizer: AutoTokenizer | None = None
        if settings.tokenizer_dir is not None:
            tokenizer = self._exporting(self._routing_tokenizer(settings.tokenizer_dir))
        elif settings.tokenizer_source == "estimate":
            self.tokenizer_metrics.estimated.set(1)
        else:
            self.auto_tokenizer = AutoTokenizer(
                self.store,
                self.tokenizer_metrics,
                self._use_tokenizer,
                lambda repo: self._routing_tokenizer(download_from_hub(repo)),
                self.clock,
            )
        self.registry.register(CalibrationCollector(settings.pool_name, lambda: self.director.tokenizer))
        self.director = Director(
            self.lifecycle,
            self.store,
            tokenizer,
            RequestMetrics(self.registry, labels),
            self.clock,
            rng,
            objective_priorities=self.objective_priorities,
            default_max_model_len=settings.max_model_len,
            flow_gate=self.flow_gate,
            metering=MeteringSettings(
                settings.response_metering,
                settings.metering_sample_every,
                settings.metering_calibration_streams,
                settings.completion_log_silence_s,
            ),
        )
        if self.sync is not None:
            self.sync.state.bytes_per_token = self._announced_bytes_per_token
        self.gate = request_gate(settings)
        self.kv_events = KVEventsSubscriber(
            self.store,
            self.kv_index,
            self.clock,
            KVEventMetrics(self.registry),
            staleness_s=settings.kv_events_staleness_s,
            replay_timeout_s=settings.kv_events_replay_timeout_s,
        )
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._ext_authz: asyncio.Server | None = None
        self.ready = False
        """Whether the EPP takes new requests (what its readiness services report)."""
        self.ext_authz_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics_server: WSGIServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._kube_api: ApiClient | None = None
        self._draining = False

    def _routing_tokenizer(self, model_dir: Path) -> PromptTokenizer:
        """The model's tokenizer from ``model_dir``, on every prompt or, with ``--tokenize-every``,
        sampled to calibrate estimated counts (``epp.tokenizer.sampling``; no prompt cache then)."""
        every = self.settings.tokenize_every
        if every > 1:
            return SampledTokenizer(load_tokenizer(model_dir), every, agreed=self._agreed_bytes_per_token)
        settings = self.settings
        return load_tokenizer(model_dir, settings.tokenizer_cache_bytes, settings.verify_tokenizer_cache)

    def _agreed_bytes_per_token(self) -> float | None:
        """The estimate's ratio the synced replicas route on, when a peer sets it."""
        return self.sync.state.agreed_bytes_per_token() if self.sync is not None else None

    def _announced_bytes_per_token(self) -> float | None:
        """Our estimate's ratio for the peers, when we route on a calibrated estimate."""
        tokenizer = self.director.tokenizer
        return tokenizer.calibration.announced if isinstance(tokenizer, Calibrated) else None

    def _exporting(self, tokenizer: PromptTokenizer) -> PromptTokenizer:
        """``tokenizer``, with its cache's metrics (if it has a cache) in place of any earlier one's."""
        if self._cache_collector is not None:
            self.registry.unregister(self._cache_collector)
            self._cache_collector = None
        if tokenizer.cache is not None:
            self._cache_collector = TokenizerCacheCollector(self.settings.pool_name, tokenizer.cache)
            self.registry.register(self._cache_collector)
        return tokenizer

    def _use_tokenizer(self, tokenizer: PromptTokenizer) -> None:
        """The ``auto`` source's tokenizer for the pool's model: route with it from the next request."""
        self.director.tokenizer = self._exporting(tokenizer)

    def _flow_gate(self, config: EndpointPickerConfig, context: PluginContext) -> FlowGate | None:
        """Flow control, when the config turns it on: requests wait while the pool is saturated."""
        flow_control = build_flow_control(config, self.pipeline, context)
        if flow_control is None:
            return None
        metrics = FlowMetrics(self.registry, self.settings.pool_name, flow_control.controller)
        # A held request wants every endpoint's figures fresh, idle ones' too (their age counts).
        return FlowGate(
            flow_control, self.store.candidates, self.clock, metrics, on_queued=self.scraper.hurry
        )

    def _replica_sync(self) -> NatsSyncTransport:
        """Active-active: share this replica's bookings with its peers over NATS, apply theirs."""
        s = self.settings
        state = ReplicaSyncState(
            self.replica_id,
            sync_targets(self.pipeline),
            clock=self.clock,
            wall_clock=time.time,
            tuning=SyncTuning(
                progress_interval_s=s.sync_progress_interval_ms / 1e3,
                heartbeat_interval_s=s.sync_heartbeat_interval_s,
                peer_timeout_s=s.sync_peer_timeout_s,
            ),
            capabilities=Capability.SHARES_SCRAPES if s.sync_share_scrapes else Capability.NONE,
        )
        attach_replica_sync(self.lifecycle, state)
        share = None
        if s.sync_share_scrapes:
            share = ScrapeShare(
                state, self.store, clock=self.clock, stale_after_s=STALE_AFTER_TICKS * s.scrape_interval_s
            )
            self.scraper.share = share
            state.on_peer_requests = self.scraper.on_peer_requests
        metrics = SyncMetrics(
            self.registry,
            s.pool_name,
            self.store,
            state,
            find_token_load(self.pipeline.plugins.values()),
            share,
        )
        return NatsSyncTransport(
            state,
            s.sync_nats_url,
            f"{s.sync_subject_prefix}.{s.sync_pool or s.pool_name}",
            connect_options=connect_options(s),
            snapshot_timeout_s=s.sync_snapshot_timeout_s,
            metrics=metrics,
            scrape_share=share,
            scrape_batch_s=s.scrape_interval_s,
        )

    async def start(self) -> None:
        s = self.settings
        if self.source is not None:
            self.source.load()
        self.scraper.start()
        self.kv_events.start()
        if self.predictor is not None:
            await self.predictor.start()
        if self.sync is not None:
            await self.sync.start()
        if self.auto_tokenizer is not None:
            self._tasks.append(asyncio.create_task(self.auto_tokenizer.run(), name="auto-tokenizer"))
        if self.source is not None:
            self._tasks.append(asyncio.create_task(self.source.watch(), name="endpoints-file"))
        else:
            await self._start_kubernetes()

        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        add_to_server(ExternalProcessor(self.director, s.max_body_bytes, self.gate), self._grpc)
        add_access_log_to_server(AccessLogReceiver(self.director.log_entry), self._grpc)
        if s.response_metering == "first-token" or s.ext_authz_port is not None:
            self._tasks.append(asyncio.create_task(self._follow_handoffs(), name="handed-off-requests"))
        if s.ext_authz_port is not None:
            check = ExtAuthzCheck(self.director, s.max_body_bytes, self.gate)
            self._ext_authz = await ext_authz_server.serve(
                check.answer, lambda: self.ready, s.host, s.ext_authz_port
            )
            self.ext_authz_port = self._ext_authz.sockets[0].getsockname()[1]
        tls = s.grpc_tls()
        address = f"{s.host}:{s.grpc_port}"
        self.grpc_port = (
            self._grpc.add_secure_port(address, server_credentials(tls))
            if tls is not None
            else self._grpc.add_insecure_port(address)
        )
        # Plaintext, for kubelet's gRPC probes (they do not speak TLS); it serves health only.
        self._health_server = grpc.aio.server(options=GRPC_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{s.host}:{s.health_port}")
        await self._grpc.start()
        await self._health_server.start()
        self._metrics_server = start_metrics_server(s.host, s.metrics_port, self.registry, self.live)
        self.metrics_port = self._metrics_server.server_port
        # Liveness at once; readiness (and the ext_proc service Envoy checks) once the endpoints
        # are known and, with leader election, only while this replica leads.
        ready_now = HEALTH_SERVICES if self.source is not None else ("", "liveness")
        self.ready = self.source is not None
        for service in HEALTH_SERVICES:
            serving = service in ready_now
            await self.health.set(
                service,
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
        log.info(
            "EPP serving ext_proc on %s:%d (%s; ext_authz %s, health %d, metrics %d), %d endpoints, "
            "profile %r",
            s.host,
            self.grpc_port,
            "plaintext" if tls is None else "mTLS" if tls.client_ca_file else "TLS",
            self.ext_authz_port or "off",
            self.health_port,
            self.metrics_port,
            len(self.store.all()),
            self.pipeline.profile.name,
        )

    async def _follow_handoffs(self) -> None:
        """Each second: move the handed-off streams' decode progress on, and finish those whose
        access-log entry never came."""
        while True:
            await asyncio.sleep(1.0)
            self.director.estimate_progress()
            if expired := self.director.expire_handoffs():
                log.warning("%d handed-off requests had no access-log entry: finished unheard", expired)

    async def _start_kubernetes(self) -> None:
        s = self.settings
        namespace = s.pool_namespace or default_namespace()
        self._kube_api = await api_client(s.kubeconfig)
        watch = PoolWatch(
            namespace, s.pool_name, ApiGroupVersion.parse(s.objective_api_version), resync_s=s.k8s_resync_s
        )
        self.k8s_source = KubernetesSource(self._kube_api, watch, self.store, self.objective_priorities)
        self._tasks.append(asyncio.create_task(self.k8s_source.run(), name="k8s-source"))
        if s.ha_enable_leader_election:
            lease = LeaseSettings(namespace, f"{s.pool_name}-epp-leader", default_identity())
            self.elector = LeaseElector(self._kube_api, lease, self._leading)
        self._tasks.append(asyncio.create_task(self._ready_when_synced(), name="k8s-readiness"))

    async def _ready_when_synced(self) -> None:
        assert self.k8s_source is not None
        await self.k8s_source.synced.wait()
        if self.elector is None:
            await self._set_ready(True)
        else:
            await self.elector.run()

    async def _leading(self, leading: bool) -> None:
        await self._set_ready(leading)

    async def _set_ready(self, ready: bool) -> None:
        serving = ready and not self._draining
        self.ready = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in READINESS_SERVICES:
            await self.health.set(service, status)

    async def begin_drain(self) -> None:
        """Report not ready from now on (the gateway's health checks and the readiness probe see
        it) while ext_proc keeps taking streams, so traffic moves to other replicas before
        :meth:`stop` refuses any. Liveness stays SERVING."""
        self._draining = True
        await self._set_ready(False)

    async def stop(self, drain_s: float = 2.0) -> None:
        """Refuse new streams, give the in-flight ones up to ``drain_s`` to end, release every port."""
        self.ready = False
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ext_authz is not None:
            self._ext_authz.close()
        if self._grpc is not None:
            await self._grpc.stop(drain_s)
        if self.flow_gate is not None:
            await self.flow_gate.close()
        if self.sync is not None:  # after the streams ended, so peers see their releases
            await self.sync.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        await self.scraper.close()
        await self.kv_events.close()
        if self.predictor is not None:
            await self.predictor.close()
        if self._kube_api is not None:
            await self._kube_api.close()
        if self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # exports the spans still batched
