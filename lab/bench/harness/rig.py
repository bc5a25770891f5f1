"""Benchmark rig: N upstream engines, the EPP, and two gateways — one through the EPP, one without."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.stub_engine import stub_engine_bootstrap
from sim.envoy_config import gateway_bootstrap, write_cluster_endpoints
from sim.models import TINY_MODEL_DIR
from sim.processes import (
    BIN,
    Component,
    free_port,
    free_port_range,
    http_ok,
    spawn,
    start_envoy,
    start_epp,
    wait_until,
    write_endpoints_file,
)


@dataclass
class GatewayRig:
    """``engine`` is ``"stub"`` (Envoy direct responses) or a simulator profile name."""

    endpoints: int
    engine: str = "stub"
    epp_args: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="llm-epp-bench-")))
    components: list[Component] = field(default_factory=list)
    epp: Component | None = None

    def __post_init__(self) -> None:
        self.with_epp_port, self.without_epp_port = free_port(), free_port()
        self.epp_metrics_port = free_port()

    @property
    def with_epp_url(self) -> str:
        return f"http://127.0.0.1:{self.with_epp_port}"

    @property
    def without_epp_url(self) -> str:
        return f"http://127.0.0.1:{self.without_epp_port}"

    def __enter__(self) -> GatewayRig:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_engines(self) -> list[int]:
        if self.engine == "stub":
            ports = [free_port() for _ in range(self.endpoints)]
            self.components.append(
                start_envoy("stub-engines", stub_engine_bootstrap(ports), self.workdir, concurrency=1)
            )
            return ports
        first = free_port_range(self.endpoints)
        ports = list(range(first, first + self.endpoints))
        argv = [
            str(BIN / "llm-epp-sim"),
            "--host",
            "127.0.0.1",
            "--port",
            str(first),
            "--replicas",
            str(self.endpoints),
            "--profile",
            self.engine,
        ]
        sim = spawn("sim", argv, self.workdir)
        self.components.append(sim)
        wait_until(sim, http_ok(f"http://127.0.0.1:{ports[-1]}/health"))
        return ports

    def _start(self) -> None:
        upstreams = [("127.0.0.1", p) for p in self._start_engines()]
        epp_port = free_port()
        self.epp = start_epp(
            self.workdir,
            write_endpoints_file(self.workdir / "endpoints.yaml", upstreams),
            grpc_port=epp_port,
            health_port=free_port(),
            metrics_port=self.epp_metrics_port,
            expected_endpoints=self.endpoints,
            tokenizer=TINY_MODEL_DIR,
            extra_args=["--log-level", "WARNING", *self.epp_args],
        )
        self.components.append(self.epp)
        cluster = write_cluster_endpoints(self.workdir / "gateway-endpoints" / "endpoints.json", upstreams)
        with_epp = gateway_bootstrap(
            listen_port=self.with_epp_port, epp_address=("127.0.0.1", epp_port), endpoints_file=cluster
        )
        without = gateway_bootstrap(
            listen_port=self.without_epp_port, epp_address=None, endpoints_file=cluster
        )
        self.components.append(start_envoy("gateway-with-epp", with_epp, self.workdir))
        self.components.append(start_envoy("gateway-without-epp", without, self.workdir))

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components.clear()
