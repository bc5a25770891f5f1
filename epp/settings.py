"""The EPP process's one configuration model. Command-line flags map onto it one to one."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epp.extproc.gate import ENVOY_MAX_HEADERS, ENVOY_MAX_HEADERS_KB
from epp.requestcontrol.completion_log import ResponseMetering
from epp.sync.nats_auth import SYNC_PASSWORD_ENV, SYNC_TOKEN_ENV
from epp.tls import ServerTlsFiles

# No default: tokenizing with any other model's vocabulary would silently skew every token
# count and never match the engines' prefix-cache blocks.
TOKENIZER_HELP = (
    "the served model's tokenizer: a directory with its tokenizer.json and tokenizer_config.json "
    "(as in the model's Hugging Face repository); the Helm chart provides one from "
    "inferenceExtension.tokenizer.* (docs/operations.md, 'Deploy on Kubernetes')"
)

# NATS subject tokens: no dots, spaces or wildcards in a replica id; dot-separated tokens in a prefix.
_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_SUBJECT = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


class EppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("0.0.0.0", description="address every EPP server binds")
    grpc_port: int = Field(9002, ge=0, le=65535, description="ext_proc gRPC port")
    grpc_tls_cert_file: Path | None = Field(
        None, description="serve ext_proc over TLS with this PEM certificate chain (reloaded when it changes)"
    )
    grpc_tls_key_file: Path | None = Field(None, description="PEM private key of --grpc-tls-cert-file")
    grpc_tls_client_ca_file: Path | None = Field(
        None, description="mTLS: refuse ext_proc clients without a certificate signed by this PEM CA bundle"
    )
    ext_authz_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also answer the gateway's HTTP ext_authz checks on this port (plaintext; the "
        "gateway's access log, sent to the gRPC port, then finishes every request it routes): "
        "the cheap callout where the gateway is an Envoy you configure",
    )
    health_port: int = Field(9003, ge=0, le=65535, description="gRPC health port (liveness, readiness)")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics port")
    otlp_traces_endpoint: str | None = Field(
        None,
        description="export one OpenTelemetry span per request to this OTLP/HTTP traces URL "
        "(http://collector:4318/v1/traces); off when unset",
    )
    otlp_service_name: str = Field("llm-epp", description="service.name of the exported spans")
    pool_name: str = Field(
        "local-pool", description="the InferencePool to serve (kubernetes source); pool label in metrics"
    )
    endpoint_source: Literal["file", "kubernetes"] = Field(
        "file", description="file: --endpoints-file; kubernetes: the InferencePool's Ready pods"
    )
    endpoints_file: Path | None = Field(None, description="static endpoints YAML, reloaded on change")
    pool_namespace: str | None = Field(
        None, description="namespace of the InferencePool, its pods and objectives (default: the pod's own)"
    )
    kubeconfig: Path | None = Field(None, description="kubeconfig file (default: in-cluster service account)")
    objective_api_version: str = Field(
        "inference.networking.x-k8s.io/v1alpha2", description="API group/version of InferenceObjective"
    )
    k8s_resync_s: float = Field(300.0, gt=0, description="full relist period of every Kubernetes watch")
    ha_enable_leader_election: bool = Field(
        False, description="active-passive replicas: only the Lease holder reports ready"
    )
    endpoints_poll_s: float = Field(1.0, gt=0, description="how often the endpoints file is checked")
    shutdown_grace_s: float = Field(
        1.5,
        ge=0,
        le=300,
        description="after SIGTERM: report NOT_SERVING but keep taking new ext_proc streams this long, "
        "so the gateway's health checks (the local stack's: every 0.5 s, down after 2) move traffic "
        "to other replicas before this one refuses any",
    )
    shutdown_drain_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="after the grace: wait at most this long for in-flight ext_proc streams to end, "
        "then cancel the rest and exit",
    )
    config: str = Field("gie-default", description="EndpointPickerConfig: a shipped name or a YAML path")
    tokenizer_source: Literal["dir", "auto", "estimate"] = Field(
        "dir",
        description="where the tokenizer comes from. dir: --tokenizer-dir. auto: the Hugging Face Hub "
        "repository the pool's /v1/models names as its model's root (with HF_TOKEN for gated ones, "
        "HF_ENDPOINT for a mirror), loaded once the pool's endpoints agree on one; until then, or "
        "if it cannot be had, token counts are estimated from the text (4 bytes a token; "
        "llm_epp_tokenizer_estimated is 1). estimate: always those estimates, no tokenizer (the "
        "cheapest: no tokenizing; precise-prefix matching finds nothing; docs/tokenizer.md)",
    )
    tokenizer_dir: Path | None = Field(None, description=f"with --tokenizer-source dir: {TOKENIZER_HELP}")
    tokenize_every: int = Field(
        1,
        ge=1,
        description="run the model's tokenizer on one prompt in this many (1: every prompt, exact "
        "counts). Over 1: the other prompts' counts are estimated from their bytes at the ratio the "
        "tokenized ones measure (~0.2 ms of EPP CPU less a 1k-token prompt); no precise-prefix "
        "matching, and the engine, not the EPP, refuses prompts longer than the context "
        "(docs/tokenizer.md)",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="context length in tokens, for prompts routed before any engine's /v1/models "
        "reported its own (longer prompts get 400)",
    )
    tokenizer_cache_bytes: int = Field(
        256 << 20,
        ge=0,
        description="memory for recent prompts' token ids, reused when a prompt extends one (0: off)",
    )
    verify_tokenizer_cache: bool = Field(
        False, description="also tokenize every reused prompt whole and count mismatches (for tests)"
    )
    scrape_interval_s: float = Field(
        0.05, gt=0, description="engine /metrics polling period while the engine is busy"
    )
    idle_scrape_interval_s: float = Field(
        1.0,
        gt=0,
        description="engine /metrics polling period while the engine is idle (nothing in flight from "
        "this EPP, nothing running or waiting at its last scrape, no request routed there or "
        "finished for 2 s); a request routed to it is scraped at once. An idle engine that stalls "
        "is out of scheduling within about this plus --scrape-timeout-s (set it to "
        "--scrape-interval-s to scrape every engine at that period always)",
    )
    scrape_timeout_s: float = Field(
        0.5,
        gt=0,
        description="an engine that shows no sign of life this long (no good /metrics scrape, no "
        "answer to a request: stalled, not merely busy) is out of scheduling until its next good scrape",
    )
    max_body_bytes: int = Field(16 << 20, ge=1024, description="larger request bodies get 413")
    max_request_headers: int = Field(
        ENVOY_MAX_HEADERS,
        ge=16,
        description="the gateway's limit on request headers (Envoy's max_headers_count): requests "
        "that leave no room under it for the EPP's own headers get a JSON 431, not the gateway's 500",
    )
    max_request_headers_kb: int = Field(
        ENVOY_MAX_HEADERS_KB, ge=4, description="the same for their size (Envoy's max_request_headers_kb)"
    )
    decision_trace_token_file: Path | None = Field(
        None,
        description="decision traces (x-llm-epp-debug) for callers that send this file's token as "
        "the header's value; off unless this or --decision-trace-from is given",
    )
    decision_trace_from: list[str] = Field(
        default_factory=list,
        description="decision traces for x-llm-epp-debug: true from these networks (CIDRs; repeat "
        "the flag or comma-separate), by the client address the gateway sends (ext_proc attribute "
        "source.address)",
    )
    response_metering: ResponseMetering = Field(
        "full",
        description="full: read every chunk of a streamed response; first-token: read it to its "
        "first token, then let the gateway's access log (sent to this EPP's gRPC port, "
        "envoy.access_loggers.http_grpc) finish it: needs a gateway that sends its log here",
    )
    metering_sample_every: int = Field(
        1000,
        ge=1,
        description="first-token metering: still read one stream in this many to its end (its bytes "
        "per token calibrate the others'; one read whole costs as much as ~30 handed off)",
    )
    metering_calibration_streams: int = Field(
        4, ge=1, description="first-token metering: read each model's first streams to their end"
    )
    completion_log_silence_s: float = Field(
        30.0,
        gt=0,
        description="first-token metering: a stream with no access-log entry this long is finished "
        "as not completed; must exceed the gateway's access_log_flush_interval (the local gateway's: 10 s)",
    )
    kv_events_staleness_s: float = Field(
        5.0, gt=0, description="a busy engine silent this long falls back to the approximate index"
    )
    kv_events_replay_timeout_s: float = Field(2.0, gt=0, description="wait for a KV-events replay answer")
    seed: int | None = Field(None, description="seed for the scheduling RNG (random if unset)")
    predictor_url: list[str] = Field(
        default_factory=list, description="predictor sidecar base URLs (repeat the flag or comma-separate)"
    )
    trainer_url: str | None = Field(None, description="trainer sidecar base URL, for training samples")
    trainer_token_file: Path | None = Field(
        None, description="file holding the trainer's bearer token (a trainer exposed beyond the pod)"
    )
    prediction_timeout_ms: float = Field(400.0, gt=0, le=10_000, description="time box of one prediction")
    prediction_coalesce_ms: float = Field(
        1.0, ge=0, le=100, description="window merging concurrent predictions"
    )

    sync_nats_url: list[str] = Field(
        default_factory=list,
        description="active-active replicas: NATS server URLs (nats:// or tls://; repeat the flag or "
        "comma-separate) through which replicas share token load and prefix state; none: sync off",
    )
    sync_pool: str | None = Field(
        None, description="replicas that sync together (NATS subject token; default: --pool-name)"
    )
    sync_subject_prefix: str = Field("llm-epp", description="first tokens of every sync subject")
    replica_id: str | None = Field(
        None, description="this replica's name among its peers, unique in the pool (default: hostname-pid)"
    )
    sync_heartbeat_interval_s: float = Field(0.5, gt=0, le=60, description="sync heartbeat period")
    sync_peer_timeout_s: float = Field(
        3.0, gt=0, le=600, description="a peer silent this long is dropped with everything it booked"
    )
    sync_progress_interval_ms: float = Field(
        50.0, gt=0, le=10_000, description="endpoints whose decode progress changed are published this often"
    )
    sync_snapshot_timeout_s: float = Field(1.0, gt=0, le=60, description="wait for a peer's snapshot")
    sync_share_scrapes: bool = Field(
        True,
        description="with sync: each engine's /metrics is scraped by one replica (chosen by rendezvous "
        "hash among the replicas that share), which publishes it to the others; a replica scrapes an "
        "engine itself while the shared view is stale (owner gone, NATS down)",
    )
    sync_nats_user: str | None = Field(None, description="NATS user (with --sync-nats-password-file)")
    sync_nats_password_file: Path | None = Field(
        None, description=f"file holding the NATS password (or set {SYNC_PASSWORD_ENV})"
    )
    sync_nats_token_file: Path | None = Field(
        None, description=f"file holding the NATS auth token (or set {SYNC_TOKEN_ENV})"
    )
    sync_nats_nkey_seed_file: Path | None = Field(None, description="NATS nkey seed file (nkey auth)")
    sync_nats_credentials_file: Path | None = Field(None, description="NATS .creds file (JWT auth)")
    sync_nats_tls_ca_file: Path | None = Field(
        None, description="CA bundle that signs the NATS server's cert"
    )
    sync_nats_tls_cert_file: Path | None = Field(None, description="client certificate for NATS mutual TLS")
    sync_nats_tls_key_file: Path | None = Field(None, description="private key of --sync-nats-tls-cert-file")

    @model_validator(mode="after")
    def _source_inputs(self) -> EppSettings:
        if self.endpoint_source == "file" and self.endpoints_file is None:
            raise ValueError("--endpoints-file is required with --endpoint-source file")
        if self.ha_enable_leader_election and self.endpoint_source != "kubernetes":
            raise ValueError("--ha-enable-leader-election needs --endpoint-source kubernetes")
        if self.ha_enable_leader_election and self.sync_nats_url:
            raise ValueError(
                "--ha-enable-leader-election (active-passive: one replica routes) and --sync-nats-url "
                "(active-active: every replica routes) exclude each other; choose one"
            )
        return self

    @model_validator(mode="after")
    def _tokenizer_inputs(self) -> EppSettings:
        if self.tokenizer_source == "dir" and self.tokenizer_dir is None:
            raise ValueError(f"--tokenizer-dir is required: {TOKENIZER_HELP} (or --tokenizer-source auto)")
        if self.tokenizer_source != "dir" and self.tokenizer_dir is not None:
            raise ValueError(f"--tokenizer-dir is for --tokenizer-source dir, not {self.tokenizer_source}")
        if self.tokenize_every > 1 and self.tokenizer_source == "estimate":
            raise ValueError("--tokenize-every samples a model's tokenizer: --tokenizer-source dir or auto")
        return self

    @model_validator(mode="after")
    def _decision_trace_inputs(self) -> EppSettings:
        for network in self.decision_trace_from:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"--decision-trace-from: {network!r} is not a CIDR") from None
        return self

    @model_validator(mode="after")
    def _tls_inputs(self) -> EppSettings:
        if (self.grpc_tls_cert_file is None) != (self.grpc_tls_key_file is None):
            raise ValueError("--grpc-tls-cert-file and --grpc-tls-key-file go together")
        if self.grpc_tls_client_ca_file is not None and self.grpc_tls_cert_file is None:
            raise ValueError(
                "--grpc-tls-client-ca-file (mTLS) needs --grpc-tls-cert-file and --grpc-tls-key-file"
            )
        return self

    def grpc_tls(self) -> ServerTlsFiles | None:
        """The ext_proc server's TLS files, or None for plaintext (h2c)."""
        if self.grpc_tls_cert_file is None or self.grpc_tls_key_file is None:
            return None
        return ServerTlsFiles(self.grpc_tls_cert_file, self.grpc_tls_key_file, self.grpc_tls_client_ca_file)

    @model_validator(mode="after")
    def _sync_inputs(self) -> EppSettings:
        if self.replica_id is not None and not _SUBJECT_TOKEN.fullmatch(self.replica_id):
            raise ValueError("--replica-id may hold only letters, digits, '_' and '-'")
        if self.sync_pool is not None and not _SUBJECT_TOKEN.fullmatch(self.sync_pool):
            raise ValueError("--sync-pool may hold only letters, digits, '_' and '-'")
        if not _SUBJECT.fullmatch(self.sync_subject_prefix):
            raise ValueError(
                "--sync-subject-prefix must be dot-separated tokens of letters, digits, '_', '-'"
            )
        if self.sync_heartbeat_interval_s * 2 > self.sync_peer_timeout_s:
            raise ValueError("--sync-peer-timeout-s must be at least twice --sync-heartbeat-interval-s")
        auth = [
            self.sync_nats_token_file,
            self.sync_nats_user,
            self.sync_nats_nkey_seed_file,
            self.sync_nats_credentials_file,
        ]
        if sum(a is not None for a in auth) > 1:
            raise ValueError(
                "give one NATS auth: a token, a user and password, an nkey seed, or a .creds file"
            )
        if self.sync_nats_password_file is not None and self.sync_nats_user is None:
            raise ValueError("--sync-nats-password-file needs --sync-nats-user")
        if (self.sync_nats_tls_cert_file is None) != (self.sync_nats_tls_key_file is None):
            raise ValueError("--sync-nats-tls-cert-file and --sync-nats-tls-key-file go together")
        return self
