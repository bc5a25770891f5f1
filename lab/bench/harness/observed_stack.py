"""A local stack under load with a real Prometheus scraping every process, and headless
Chromium: what the observability test and the dashboard previews run on.

Prometheus and Chromium are Debian's packages (``make system-packages``, which ``make test``
runs). The stack has two synced EPP replicas, the trainer, one predictor and two simulated
engines, so every metric the dashboards and alerts use exists.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import yaml

from sim.processes import Component, free_port, http_ok, spawn, wait_until
from sim.stack import LocalStack, StackConfig, StackPorts

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def system_binary(name: str) -> str:
    """The path of ``name`` from the system packages; a clear error when the install step is missing."""
    path = shutil.which(name)
    if path is None:
        # A missing install step is an error to fix, not a reason to skip.
        raise RuntimeError(f"{name} is not installed: run `make system-packages` (make test runs it)")
    return path


def run_chromium(
    url: str, profile: Path, *args: str, timeout_s: float = 90
) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url`` with a fresh profile directory and ``args`` (``--dump-dom``,
    ``--screenshot=PATH``, ...); raise if it fails."""
    profile.mkdir(parents=True)
    result = subprocess.run(
        [system_binary("chromium"), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"chromium exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def start_prometheus(workdir: Path, port: int, targets: Mapping[str, Sequence[str]]) -> Component:
    """Prometheus on loopback ``port`` scraping ``targets`` (job → host:port list, path
    /metrics) every second; the caller stops it."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
            for job, addresses in targets.items()
        ],
    }
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [
        system_binary("prometheus"),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={workdir / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    server = spawn("prometheus", argv, workdir)
    wait_until(server, http_ok(f"http://127.0.0.1:{port}/-/ready"), timeout=60)
    return server


class Load:
    """Clients sending streamed completions through the gateway until stopped: prompts of many
    lengths (so the trainer learns a model that beats a constant), every other one with SLOs no
    engine can meet, and every 25th for a model nobody serves (a 404)."""

    def __init__(self, gateway_url: str, clients: int = 3) -> None:
        self.client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
        self.stopping = threading.Event()
        self.sent = 0
        self.pool = cf.ThreadPoolExecutor(clients)
        self.workers = [self.pool.submit(self._run, i, clients) for i in range(clients)]

    def _one(self, i: int) -> None:
        impossible = i % 2 == 0
        headers = (
            {"x-slo-ttft-ms": "0.01", "x-slo-tpot-ms": "0.001"} if impossible else {"x-slo-ttft-ms": "60000"}
        )
        model = "no-such-model" if i % 25 == 7 else "tiny"
        try:
            stream = self.client.completions.create(
                model=model, prompt="word " * (10 + (i * 137) % 1500), max_tokens=4 + i % 24,
                stream=True, extra_headers=headers,
            )  # fmt: skip
            for _ in stream:
                pass
        except openai.NotFoundError:
            if model != "no-such-model":
                raise

    def _run(self, first: int, step: int) -> None:
        i = first
        while not self.stopping.is_set():
            self._one(i)
            self.sent += 1
            i += step

    def stop(self) -> None:
        """Stop the clients; raise what any of them raised."""
        self.stopping.set()
        for worker in self.workers:
            worker.result()
        self.pool.shutdown()


@dataclass
class ObservedStack:
    stack: LocalStack
    prometheus_url: str
    load: Load
    workdir: Path

    @property
    def page_url(self) -> str:
        """The first EPP's live page."""
        return f"http://127.0.0.1:{self.stack.epp_ports[0][2]}/dashboard"


@contextlib.contextmanager
def observed_stack(
    workdir: Path, stack_class: type[LocalStack] = LocalStack, epp_args: Sequence[str] = ()
) -> Iterator[ObservedStack]:
    """Start the stack (a ``stack_class``, its EPPs given ``epp_args``), Prometheus and the
    load; stop all three on exit."""
    config = StackConfig(
        replicas=2, predictors=1, epp_replicas=2, ports=StackPorts.free(), workdir=workdir, epp_args=epp_args,
        trainer_args=["--retrain-interval-s", "1", "--min-samples", "30"],
    )  # fmt: skip
    stack = stack_class(config)
    stack.start()
    prometheus: Component | None = None
    load: Load | None = None
    try:
        port = free_port()
        loopback = "127.0.0.1:{}".format
        targets = {
            "epp": [loopback(metrics) for _, _, metrics in stack.epp_ports],
            "trainer": [loopback(config.ports.trainer)],
            "predictor": [loopback(p) for p in stack.predictor_ports],
            "vllm": [loopback(p) for p in stack.replica_ports],
        }
        prometheus = start_prometheus(workdir, port, targets)
        load = Load(stack.gateway_url)
        yield ObservedStack(stack, f"http://127.0.0.1:{port}", load, workdir)
    finally:
        try:
            if load is not None:
                load.stop()
        finally:
            if prometheus is not None:
                prometheus.stop()
            stack.stop()
