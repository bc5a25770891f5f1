"""``llm-epp-stack``: the whole gateway on loopback — real Envoy, the EPP, and vLLM replicas,
simulated (default) or real (``--engine vllm``: the CPU build of vLLM serving a tiny model).
With ``--epp-replicas N`` (N > 1) it runs N EPPs active-active: a nats-server, the EPPs synced
through it, and Envoy with all of them in its ext_proc cluster (health-checked over gRPC).
With ``--tls tls`` the EPP serves ext_proc over TLS with a certificate from a throwaway CA
(:mod:`sim.certs`, in the workdir) that Envoy verifies; ``--tls mtls`` also makes the EPP
require Envoy's client certificate.

Every component is a separate process in its own process group, started in dependency order
(replicas, EPP, Envoy) and each waited on until it answers; ``stop()`` ends them all, and they
end by themselves if the stack is killed (see ``sim.processes.spawn``). The integration tests
use the same class, on free ports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from epp.extproc.envoy_contract import INFERENCE_API_PATHS
from epp.requestcontrol.completion_log import ResponseMetering
from sim.certs import LocalPki, write_local_pki
from sim.engine import ProfileError
from sim.engine.pool import PROFILE_LABEL, pool_profiles, pool_size, pool_variants
from sim.envoy_config import (
    BodyMode,
    Callout,
    EppTls,
    FailureMode,
    gateway_bootstrap,
    with_epp_replicas,
    write_cluster_endpoints,
)
from sim.models import TINY_MODEL_DIR
from sim.nats_server import start_nats_server
from sim.processes import (
    BIN,
    Component,
    ProcessError,
    free_port,
    http_ok,
    port_in_use,
    spawn,
    start_envoy,
    start_epp,
    wait_until,
    write_endpoints_file,
)
from sim.real_vllm import VllmReplicaSpec, start_vllm_replicas

TokenizerSource = Literal["dir", "auto", "estimate"]
"""The EPP's ``--tokenizer-source``."""


@dataclass
class StackPorts:
    gateway: int = 8081
    epp_grpc: int = 9002
    epp_health: int = 9003
    epp_metrics: int = 9090
    envoy_admin: int = 9901
    first_replica: int = 8100
    trainer: int = 8000
    first_predictor: int = 8001
    nats: int = 4222
    """The nats-server that syncs EPP replicas (with more than one)."""

    @classmethod
    def free(cls) -> StackPorts:
        """Free ports for every process; replicas and predictors get individual free ports."""
        return cls(
            *(free_port() for _ in range(5)),
            first_replica=0,
            trainer=free_port(),
            first_predictor=0,
            nats=free_port(),
        )


TlsMode = Literal["off", "tls", "mtls"]


@dataclass
class StackConfig:
    replicas: int = 4
    engine: Literal["sim", "vllm"] = "sim"
    ports: StackPorts = field(default_factory=StackPorts)
    sim_profile: str = "default"
    """The simulated engines' pool (``sim.engine.pool``): one profile, or ``NAME:COUNT,...``."""
    sim_args: Sequence[str] = ()
    epp_config: str | None = None
    """EndpointPickerConfig name or path; default: ``predicted-latency`` with predictors, else
    ``gie-default``."""
    epp_args: Sequence[str] = ()
    predictors: int = 0
    """Prediction sidecars (plus one trainer) to run; 0 runs none."""
    trainer_args: Sequence[str] = ()
    failure_mode: FailureMode = "FailClose"
    body_mode: BodyMode = "BUFFERED"
    """How Envoy sends request bodies to the EPP (``sim.envoy_config``)."""
    model: str = "tiny"
    model_dir: Path = TINY_MODEL_DIR
    """The served model: the replicas serve it and the EPP tokenizes with its tokenizer."""
    tokenizer_source: TokenizerSource = "dir"
    """dir: the EPP reads ``model_dir``; auto: it downloads the tokenizer the replicas' /v1/models
    names (give them ``--model-root`` in ``sim_args``, the Hub's address in ``epp_env``);
    estimate: it counts tokens from the text, no tokenizer."""
    epp_env: Mapping[str, str] = field(default_factory=dict)
    """Added to the EPPs' environment (e.g. ``HF_ENDPOINT``, ``HF_HOME``)."""
    workdir: Path | None = None
    kv_events: bool = False
    """Simulated replicas publish KV events (with a replay socket) and the EPP subscribes."""
    api_paths: Sequence[str] = INFERENCE_API_PATHS
    """Request paths the gateway routes to the replicas; any other gets a 404."""
    epp_replicas: int = 1
    """EPP processes. More than one run active-active, synced through a nats-server the stack
    starts; the first uses the ``epp_*`` ports, the others free ports."""
    tls: TlsMode = "off"
    """ext_proc between Envoy and the EPPs: plaintext, TLS (Envoy verifies the EPP against a
    throwaway CA) or mTLS (the EPPs also require Envoy's client certificate)."""
    decision_trace_from: Sequence[str] = ("127.0.0.0/8", "::1/128")
    """Networks whose ``x-llm-epp-debug: true`` gets the decision trace (the EPPs'
    ``--decision-trace-from``): loopback, so the local stack's curls show it; none: off."""
    response_metering: ResponseMetering = "first-token"
    """How the EPPs meter streamed responses: to the first token, finished by the gateway's
    access log (which the gateway then sends them), or every chunk (``epp.requestcontrol.completion_log``)."""
    callout: Callout = "ext-proc"
    """How the gateway asks the EPP: an ext_proc stream per request, or an HTTP ext_authz check
    (``epp.extauthz.check``; plaintext, the access log finishes every request)."""


def replica_id(index: int) -> str:
    """The ``--replica-id`` of the stack's EPP replica ``index``."""
    return f"epp-{index}"


def port_flag(name: str) -> str:
    """The ``llm-epp-stack`` flag that sets the :class:`StackPorts` field ``name``."""
    return f"--{name.replace('_', '-')}-port"


class LocalStack:
    """Starts and stops the processes of one local gateway."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._own_workdir = config.workdir is None
        self.workdir = Path(config.workdir or tempfile.mkdtemp(prefix="llm-epp-stack-"))
        self.replica_ports = (
            [config.ports.first_replica + i for i in range(config.replicas)]
            if config.ports.first_replica
            else [free_port() for _ in range(config.replicas)]
        )
        self.predictor_ports = (
            [config.ports.first_predictor + i for i in range(config.predictors)]
            if config.ports.first_predictor
            else [free_port() for _ in range(config.predictors)]
        )
        ports = config.ports
        self.epp_ports = [(ports.epp_grpc, ports.epp_health, ports.epp_metrics)] + [
            (free_port(), free_port(), free_port()) for _ in range(config.epp_replicas - 1)
        ]
        """(ext_proc, health, metrics) port of each EPP."""
        if config.callout == "ext-authz" and config.tls != "off":
            raise ValueError("the ext-authz callout is plaintext")
        self.ext_authz_ports = [free_port() for _ in self.epp_ports] if config.callout == "ext-authz" else []
        """Each EPP's HTTP ext_authz port, with that callout."""
        self.replicas: list[Component] = []
        self.trainer: Component | None = None
        self.predictors: list[Component] = []
        self.nats: Component | None = None
        self.epps: list[Component] = []
        self.epp: Component | None = None
        """The first EPP (the only one unless ``epp_replicas`` > 1)."""
        self.envoy: Component | None = None
        self.pki: LocalPki | None = None
        """The throwaway CA and certificates, with ``tls`` on (written by ``start()``)."""

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.config.ports.gateway}"

    @property
    def epp_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config.ports.epp_metrics}/metrics"

    @property
    def epp_metrics_urls(self) -> list[str]:
        """Every EPP's /metrics, in start order."""
        return [f"http://127.0.0.1:{metrics}/metrics" for _, _, metrics in self.epp_ports]

    def replica_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.replica_ports[index]}"

    @property
    def trainer_url(self) -> str:
        return f"http://127.0.0.1:{self.config.ports.trainer}"

    def predictor_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.predictor_ports[index]}"

    def _start_latency_sidecars(self) -> list[str]:
        """Start the trainer and predictors; return the EPP flags that point at them."""
        if not self.config.predictors:
            return []
        self.trainer = spawn(
            "trainer",
            [str(BIN / "llm-epp-trainer"), "--host", "127.0.0.1", "--port", str(self.config.ports.trainer),
             "--model-dir", str(self.workdir / "models"), *self.config.trainer_args],
            self.workdir,
        )  # fmt: skip
        wait_until(self.trainer, http_ok(f"{self.trainer_url}/healthz"))
        for i, port in enumerate(self.predictor_ports):
            predictor = spawn(
                f"predictor-{i}",
                [str(BIN / "llm-epp-predictor"), "--host", "127.0.0.1", "--port", str(port),
                 "--trainer-url", self.trainer_url, "--poll-interval-s", "1"],
                self.workdir,
            )  # fmt: skip
            self.predictors.append(predictor)
            wait_until(predictor, http_ok(f"{self.predictor_url(i)}/healthz"))
        urls = ",".join(self.predictor_url(i) for i in range(self.config.predictors))
        return ["--predictor-url", urls, "--trainer-url", self.trainer_url]

    def vllm_spec(self, index: int) -> VllmReplicaSpec:
        return VllmReplicaSpec(
            port=self.replica_ports[index],
            workdir=self.workdir,
            served_model_name=self.config.model,
            model_dir=self.config.model_dir,
        )

    def _start_replicas(self) -> list[Component]:
        if self.config.engine == "vllm":
            indexes = range(self.config.replicas)
            return start_vllm_replicas(
                [self.vllm_spec(i) for i in indexes], [f"replica-{i}" for i in indexes]
            )
        return [self.start_replica(i) for i in range(self.config.replicas)]

    def start_replica(self, index: int) -> Component:
        port = self.replica_ports[index]
        argv = [
            str(BIN / "llm-epp-sim"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            self.config.model,
            "--model-dir",
            str(self.config.model_dir),
            "--profile",
            pool_variants(self.config.sim_profile, self.config.replicas)[index],
            *self.config.sim_args,
        ]
        if self.config.kv_events:
            events, replay = self.kv_event_sockets(index)
            config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
            argv += ["--kv-events-config", json.dumps(config)]
        component = spawn(f"replica-{index}", argv, self.workdir)
        wait_until(component, http_ok(f"http://127.0.0.1:{port}/health"))
        return component

    @property
    def cluster_endpoints_file(self) -> Path:
        """The gateway's model-server endpoints (Envoy reloads it when it is replaced)."""
        return self.workdir / "gateway-endpoints" / "endpoints.json"

    def write_endpoints(self, indexes: Sequence[int] | None = None) -> Path:
        """(Re)write the EPP's endpoints file, and the gateway's, with the given replicas (all by
        default); return the EPP's."""
        indexes = range(self.config.replicas) if indexes is None else indexes
        endpoints = [("127.0.0.1", self.replica_ports[i]) for i in indexes]
        write_cluster_endpoints(self.cluster_endpoints_file, endpoints)
        labels = None  # a simulated replica carries its variant, as a pod carries its accelerator
        if self.config.engine == "sim":
            variants = pool_variants(self.config.sim_profile, self.config.replicas)
            labels = [{PROFILE_LABEL: variants[i]} for i in indexes]
        return write_endpoints_file(
            self.workdir / "endpoints.yaml",
            endpoints,
            [self.kv_event_sockets(i) for i in indexes] if self.config.kv_events else None,
            labels,
        )

    def kv_event_sockets(self, index: int) -> tuple[str, str]:
        """Replica ``index``'s KV-event publisher and replay sockets (``ipc://`` in the workdir)."""
        return f"ipc://{self.workdir}/kv-{index}.sock", f"ipc://{self.workdir}/kv-replay-{index}.sock"

    def _epp_tls_args(self) -> list[str]:
        """Make the throwaway PKI (with ``tls`` on) and return the EPP's TLS flags."""
        if self.config.tls == "off":
            return []
        self.pki = write_local_pki(self.workdir / "tls")
        args = ["--grpc-tls-cert-file", str(self.pki.server_cert_file)]
        args += ["--grpc-tls-key-file", str(self.pki.server_key_file)]
        if self.config.tls == "mtls":
            args += ["--grpc-tls-client-ca-file", str(self.pki.ca_file)]
        return args

    @property
    def epp_tls(self) -> EppTls | None:
        """How Envoy reaches the EPPs: verifying them against the stack's CA, with its client
        certificate under mTLS; None for plaintext."""
        if self.pki is None:
            return None
        client = self.config.tls == "mtls"
        return EppTls(
            self.pki.ca_file,
            self.pki.server_name,
            self.pki.client_cert_file if client else None,
            self.pki.client_key_file if client else None,
        )

    def gateway_config(
        self, listen_port: int, epp_tls: EppTls | None, failure_mode: FailureMode | None = None
    ) -> dict[str, Any]:
        """The Envoy bootstrap of a gateway on ``listen_port`` in front of the stack's EPPs."""
        bootstrap = gateway_bootstrap(
            listen_port=listen_port,
            epp_address=("127.0.0.1", self.config.ports.epp_grpc),
            endpoints_file=self.cluster_endpoints_file,
            failure_mode=failure_mode or self.config.failure_mode,
            body_mode=self.config.body_mode,
            api_paths=self.config.api_paths,
            epp_tls=epp_tls,
            access_log_to_epp=self.config.response_metering == "first-token",
            ext_authz_port=self.ext_authz_ports[0] if self.ext_authz_ports else None,
        )
        if self.config.epp_replicas > 1:
            replicas = [("127.0.0.1", g, h) for g, h, _ in self.epp_ports]
            ids = [replica_id(i) for i in range(len(replicas))]
            bootstrap = with_epp_replicas(bootstrap, replicas, self.ext_authz_ports, ids)
        return bootstrap

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def bound_ports(self) -> dict[int, str]:
        """Every port the stack's processes will bind → the :class:`StackPorts` field that sets it."""
        ports = dataclasses.asdict(self.config.ports)
        always = ("gateway", "epp_grpc", "epp_health", "epp_metrics", "envoy_admin")
        used = {ports[name]: name for name in always}
        used.update((port, "first_replica") for port in self.replica_ports)
        if self.config.predictors:
            used[ports["trainer"]] = "trainer"
            used.update((port, "first_predictor") for port in self.predictor_ports)
        if self.config.epp_replicas > 1:
            used[ports["nats"]] = "nats"
        return used

    def _check_ports_free(self) -> None:
        for port, name in self.bound_ports().items():
            if port_in_use(port):
                raise ProcessError(
                    f"port {port} is in use by another process (`ss -ltnp 'sport = :{port}'` names it): "
                    f"stop it, or choose another port with {port_flag(name)}"
                )

    def _start(self) -> None:
        ports = self.config.ports
        self._check_ports_free()
        self.replicas = self._start_replicas()
        latency_flags = self._start_latency_sidecars()
        default_config = "predicted-latency" if self.config.predictors else "gie-default"
        epp_config = self.config.epp_config or default_config
        epp_args = [
            "--config",
            epp_config,
            "--response-metering",
            self.config.response_metering,
            *latency_flags,
            *self._epp_tls_args(),
            *(
                ["--decision-trace-from", ",".join(self.config.decision_trace_from)]
                if self.config.decision_trace_from
                else []
            ),
            *self.config.epp_args,
        ]
        if self.config.epp_replicas == 1:
            self.epp = start_epp(
                self.workdir,
                self.write_endpoints(),
                grpc_port=ports.epp_grpc,
                health_port=ports.epp_health,
                metrics_port=ports.epp_metrics,
                expected_endpoints=self.config.replicas,
                tokenizer=self._epp_tokenizer,
                env=self.config.epp_env,
                # One EPP: no other replica takes new streams while it drains, so no grace.
                extra_args=["--shutdown-grace-s", "0", *epp_args, *self._ext_authz_args(0)],
            )
            self.epps = [self.epp]
        else:
            self._start_synced_epps(epp_args)
        bootstrap = self.gateway_config(ports.gateway, self.epp_tls)
        self.envoy = start_envoy("envoy", bootstrap, self.workdir, admin_port=ports.envoy_admin)

    def _ext_authz_args(self, replica: int) -> list[str]:
        return ["--ext-authz-port", str(self.ext_authz_ports[replica])] if self.ext_authz_ports else []

    @property
    def _epp_tokenizer(self) -> Path | TokenizerSource:
        source = self.config.tokenizer_source
        return self.config.model_dir if source == "dir" else source

    def _start_synced_epps(self, epp_args: list[str]) -> None:
        """A nats-server, then every EPP replica syncing through it (``epp-0``, ``epp-1``, ...)."""
        self.nats = start_nats_server(self.workdir, self.config.ports.nats)
        endpoints = self.write_endpoints()
        for i, (grpc, health, metrics) in enumerate(self.epp_ports):
            sync_args = [
                "--sync-nats-url",
                f"nats://127.0.0.1:{self.config.ports.nats}",
                "--replica-id",
                replica_id(i),
            ]
            self.epps.append(
                start_epp(
                    self.workdir,
                    endpoints,
                    grpc_port=grpc,
                    health_port=health,
                    metrics_port=metrics,
                    expected_endpoints=self.config.replicas,
                    tokenizer=self._epp_tokenizer,
                    env=self.config.epp_env,
                    extra_args=[*epp_args, *sync_args, *self._ext_authz_args(i)],
                    name=f"epp-{i}",
                )
            )
        self.epp = self.epps[0]

    def components(self) -> list[Component]:
        """Every started process, gateway first."""
        started = [self.envoy, *self.epps, self.nats, *self.predictors, self.trainer, *self.replicas]
        return [c for c in started if c is not None]

    def stop(self) -> None:
        for component in self.components():
            component.stop()
        if self.config.engine == "vllm":
            for i in range(self.config.replicas):
                shutil.rmtree(self.vllm_spec(i).tmpdir, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _try_it(stack: LocalStack) -> str:
    body = json.dumps(
        {
            "model": stack.config.model,
            "messages": [{"role": "user", "content": "Tell me about prefix caching."}],
            "max_tokens": 32,
            "stream": True,
        }
    )
    slo = (
        " -H 'x-slo-ttft-ms: 500' -H 'x-slo-tpot-ms: 50' -H 'x-llm-epp-debug: true'"
        if stack.predictors
        else ""
    )
    url = f"{stack.gateway_url}/v1/chat/completions"
    lines = [f"  curl -N {url} -H 'content-type: application/json'{slo} -d '{body}'"]
    if len(stack.epps) > 1:
        lines += [
            "",
            "Each EPP's share of the token load that its peers booked (synced through NATS):",
            *(
                f"  curl -s {url} | grep '^llm_epp_endpoint_remote_token_share'"
                for url in stack.epp_metrics_urls
            ),
        ]
    if stack.predictors:
        lines += [
            "",
            "Predicted vs actual TTFT (the model trains for a few seconds first; -i on curl shows",
            "x-llm-epp-predicted-ttft-ms per request):",
            f"  curl -s {stack.epp_metrics_url} | grep -E "
            "'^inference_objective_request_(predicted_)?ttft_seconds_(sum|count)'",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llm-epp-stack", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine", choices=["sim", "vllm"], default="sim", help="simulated or real vLLM replicas"
    )
    parser.add_argument("--replicas", type=int, default=None, help="default: 4 simulated or 2 real")
    for port in dataclasses.fields(StackPorts):
        parser.add_argument(
            port_flag(port.name), type=int, default=port.default, dest=port.name, metavar="PORT",
            help=f"default: {port.default}",
        )  # fmt: skip
    parser.add_argument(
        "--sim-profile",
        default="default",
        help="simulated engine profile, or a mixed pool NAME[+KEY=VALUE...]:COUNT,... whose counts set "
        "--replicas (e.g. default:2,default+slowdown=2.5:2; see lab/sim/engine/pool.py)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="EndpointPickerConfig name or path (default: predicted-latency, or "
        "gie-default with --predictors 0)",
    )
    parser.add_argument(
        "--predictors", type=int, default=2, help="prediction sidecars (0: no trainer/predictors)"
    )
    parser.add_argument("--failure-mode", choices=["FailOpen", "FailClose"], default="FailClose")
    parser.add_argument(
        "--api-path",
        action="append",
        default=[],
        metavar="PATH",
        help=f"another request path the gateway routes to the replicas (repeatable; always: "
        f"{', '.join(INFERENCE_API_PATHS)}); any other path gets a 404",
    )
    parser.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="EPP processes; more than one run active-active, synced through a nats-server",
    )
    parser.add_argument(
        "--tls",
        choices=["off", "tls", "mtls"],
        default="off",
        help="ext_proc over TLS that Envoy verifies (a throwaway CA in the logs directory), or mTLS",
    )
    parser.add_argument(
        "--response-metering",
        choices=["first-token", "full"],
        default="first-token",
        help="first-token: the EPP reads a streamed answer to its first token and Envoy's access log "
        "finishes it; full: the EPP reads every chunk",
    )
    parser.add_argument(
        "--callout",
        choices=["ext-proc", "ext-authz"],
        default="ext-proc",
        help="how Envoy asks the EPP: an ext_proc stream per request, or one HTTP ext_authz check "
        "(cheaper; plaintext; the access log finishes every request)",
    )
    parser.add_argument(
        "--tokenizer-source",
        choices=["dir", "estimate"],
        default="dir",
        help="the EPP's tokenizer: the served model's (dir), or token counts estimated from the "
        "text (estimate: no tokenizing; docs/tokenizer.md)",
    )
    args = parser.parse_args(argv)
    if args.epp_replicas < 1:
        parser.error("--epp-replicas must be at least 1")
    try:
        replicas = args.replicas or pool_size(args.sim_profile) or (2 if args.engine == "vllm" else 4)
        if args.engine == "sim":
            pool_profiles(args.sim_profile, replicas)
    except ProfileError as exc:
        parser.error(str(exc))
    ports = StackPorts(**{port.name: getattr(args, port.name) for port in dataclasses.fields(StackPorts)})
    stack = LocalStack(
        StackConfig(
            replicas=replicas,
            engine=args.engine,
            ports=ports,
            sim_profile=args.sim_profile,
            epp_config=args.config,
            predictors=args.predictors,
            failure_mode=args.failure_mode,
            api_paths=[*INFERENCE_API_PATHS, *args.api_path],
            epp_replicas=args.epp_replicas,
            tls=args.tls,
            response_metering=args.response_metering,
            callout=args.callout,
            tokenizer_source=args.tokenizer_source,
        )
    )
    kind = "real vLLM (CPU, up to a few minutes)" if args.engine == "vllm" else "simulated"
    sidecars = f", a trainer, {args.predictors} predictors" if args.predictors else ""
    epps = "the EPP" if args.epp_replicas == 1 else f"nats-server, {args.epp_replicas} synced EPPs"
    print(f"starting {replicas} {kind} replicas{sidecars}, {epps} and Envoy (logs in {stack.workdir}) ...")
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        stack.start()
        if stack.pki is not None:
            print(f"\next_proc is {args.tls.upper()}: Envoy verifies the EPP against {stack.pki.ca_file}")
        print(f"\nGateway ready on {stack.gateway_url} (EPP metrics: {stack.epp_metrics_url}). Try:\n")
        print(_try_it(stack) + "\n")
        print("Ctrl-C stops everything.")
        while not stopping:
            for component in stack.components():
                if not component.alive():
                    raise ProcessError(f"{component.name} exited:\n{component.log_tail()}")
            time.sleep(0.5)
    except ProcessError as exc:
        print(f"llm-epp-stack: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        print("stopping ...")
        stack.stop()


if __name__ == "__main__":
    main()
