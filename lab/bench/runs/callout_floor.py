"""What each callout costs before the EPP does any work: ext_proc over grpc.aio against ext_authz
over the EPP's own HTTP server, both through the gateway's real Envoy config.

Two floor servicers, each in its own process on uvloop, that pick the next replica in turn and
read nothing: ``bench.harness.grpc_floor`` (the EPP's gRPC server and reply builders; request headers,
a BUFFERED body, response headers) and :func:`serve_authz` (the EPP's ext_authz server,
``epp.extauthz.server``, with the gRPC access-log receiver the callout needs, dropping each
entry). Each stands behind ``gateway_bootstrap`` with its callout, over stub engines made of
Envoy direct responses (``bench.harness.stub_engine``), driven open loop at ``rate`` requests a second of
~1k-token completions for ``seconds``: the servicer's and Envoy's CPU per request.

    .venv/bin/python -m bench.runs.callout_floor [--rate 150] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import uvloop

from bench.harness.process_cpu import task_cpu_seconds
from bench.harness.stub_engine import stub_engine_bootstrap
from epp.app import GRPC_OPTIONS
from epp.extauthz.check import Check, CheckAnswer
from epp.extauthz.server import serve
from epp.extproc.access_log import AccessLogReceiver
from epp.extproc.access_log import add_to_server as add_access_log_to_server
from epp.extproc.messages import DESTINATION_HEADER
from sim.envoy_config import Callout, gateway_bootstrap, write_cluster_endpoints
from sim.measure.report import machine, markdown_table, write_results
from sim.processes import free_port, port_in_use, spawn, start_envoy, wait_until

CALLOUTS: tuple[Callout, ...] = ("ext-proc", "ext-authz")


@dataclass
class FloorSettings:
    rate: float = 150.0
    seconds: float = 10.0
    replicas: int = 4
    prompt_words: int = 500


async def serve_authz(grpc_port: int, authz_port: int, targets: Sequence[str]) -> None:
    """Answer every check with the next of ``targets``; take the access log and drop it."""
    picks = itertools.cycle(targets)

    async def answer(check: Check) -> CheckAnswer:
        return CheckAnswer(200, {DESTINATION_HEADER: next(picks)})

    logs = grpc.aio.server(options=GRPC_OPTIONS)
    add_access_log_to_server(AccessLogReceiver(lambda entry: None), logs)
    logs.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await logs.start()
    await serve(answer, lambda: True, "127.0.0.1", authz_port)
    await logs.wait_for_termination()


async def _drive(url: str, rate: float, seconds: float, prompt: str) -> int:
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            async with session.post(url, json=body) as response:
                await response.read()
                response.raise_for_status()

        tasks, started = [], time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            due = len(tasks) / rate
            if due > elapsed:
                await asyncio.sleep(due - elapsed)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return len(tasks)


def _cell(
    callout: Callout, ports: list[int], endpoints: Path, s: FloorSettings, workdir: Path
) -> dict[str, Any]:
    grpc_port, authz_port, gateway = free_port(), free_port(), free_port()
    targets = [f"127.0.0.1:{port}" for port in ports]
    if callout == "ext-proc":
        argv = [sys.executable, "-m", "bench.harness.grpc_floor", "--port", str(grpc_port)]
        argv += [arg for target in targets for arg in ("--target", target)]
    else:
        argv = [
            sys.executable,
            "-m",
            "bench.runs.callout_floor",
            "--serve-authz",
            str(grpc_port),
            str(authz_port),
            *targets,
        ]
    servicer = spawn(f"{callout}-floor", argv, workdir)
    listening = authz_port if callout == "ext-authz" else grpc_port
    envoy = None
    try:
        wait_until(servicer, lambda: port_in_use(listening))
        bootstrap = gateway_bootstrap(
            listen_port=gateway,
            epp_address=("127.0.0.1", grpc_port),
            endpoints_file=endpoints,
            ext_authz_port=authz_port if callout == "ext-authz" else None,
        )
        envoy = start_envoy(f"gateway-{callout}", bootstrap, workdir)
        url = f"http://127.0.0.1:{gateway}/v1/completions"
        prompt = "hello world " * (s.prompt_words // 2)
        asyncio.run(_drive(url, s.rate, 2.0, prompt))  # warm-up
        pids = servicer.process.pid, envoy.process.pid
        before = [task_cpu_seconds(pid) for pid in pids]
        requests = asyncio.run(_drive(url, s.rate, s.seconds, prompt))
        time.sleep(0.5)  # the last access-log batch
        used = [task_cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
        return {
            "callout": callout,
            "requests": requests,
            "servicer_us": used[0] / requests * 1e6,
            "envoy_us": used[1] / requests * 1e6,
        }
    finally:
        if envoy is not None:
            envoy.stop()
        servicer.stop()


def measure(s: FloorSettings) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="callout-floor-") as scratch:
        workdir = Path(scratch)
        ports = [free_port() for _ in range(s.replicas)]
        stub = start_envoy("stub-engines", stub_engine_bootstrap(ports), workdir)
        try:
            endpoints = write_cluster_endpoints(
                workdir / "endpoints" / "eds.json", [("127.0.0.1", p) for p in ports]
            )
            return [_cell(callout, ports, endpoints, s, workdir) for callout in CALLOUTS]
        finally:
            stub.stop()


def _markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = [[c["callout"], f"{c['servicer_us']:,.0f}", f"{c['envoy_us']:,.0f}"] for c in data["cells"]]
    return "\n\n".join(
        [
            "# The callouts' floor",
            f"A servicer that only picks, behind the gateway's Envoy, {s['rate']:g} completions a second "
            f"(~1k-token prompts) for {s['seconds']:g} s over {s['replicas']} stub engines; load average "
            f"{data['load_before']} before, {data['load_after']} after.",
            markdown_table(["callout", "servicer µs / request", "Envoy µs / request"], rows),
        ]
    )


def run(out_dir: Path, settings: FloorSettings | None = None) -> dict[str, Any]:
    s = settings or FloorSettings()
    data: dict[str, Any] = {
        "machine": machine(),
        "settings": asdict(s),
        "load_before": f"{os.getloadavg()[0]:.2f}",
    }
    data["cells"] = measure(s)
    data["load_after"] = f"{os.getloadavg()[0]:.2f}"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_results(out_dir, "callout_floor", data, _markdown(data))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("results/callout_floor"))
    parser.add_argument("--serve-authz", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_authz:
        grpc_port, authz_port, *targets = args.serve_authz
        uvloop.run(serve_authz(int(grpc_port), int(authz_port), targets))
        return
    print(json.dumps(run(args.out, FloorSettings(rate=args.rate, seconds=args.seconds))["cells"], indent=1))


if __name__ == "__main__":
    main()
