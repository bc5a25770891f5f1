"""What a streamed answer costs the EPP and Envoy under each response metering.

The ``make run`` stack (simulated replicas, predicted-latency with its trainer and predictors),
once per ``--response-metering``: ``full`` (every chunk of the answer crosses ext_proc) and
``first-token`` (the EPP reads to the first token, then Envoy's access log finishes the request).
In each: streamed chat answers of 1 and of 512 tokens (``ignore_eos``), ``concurrency`` at a
time; the EPP's CPU per request net of its idle rate, and Envoy's CPU per request.

The first-token run sends each model's calibration streams first, so its figures are those of
handed-off streams. With the shipped sampling one stream in N is still read to its end, at the
full run's cost, so the mean over all requests is ``(1 - 1/N) × first-token + 1/N × full``: the
``shipped`` rows. The EPPs scrape their engines every ``scrape_interval_s`` here (0.5 s, not
``make run``'s 50 ms), so that the idle cost charged over a long answer's seconds does not
drown the per-request figures; the idle cost is measured on its own elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib.pyplot as plt

from bench.report import machine, markdown_table, save_figure, write_results
from bench.stack_overhead import task_cpu_seconds
from epp.settings import EppSettings
from sim.stack import LocalStack, StackConfig, StackPorts

SHIPPED_SAMPLE_EVERY: int = EppSettings.model_fields["metering_sample_every"].default
CALIBRATION_STREAMS: int = EppSettings.model_fields["metering_calibration_streams"].default


@dataclass
class MeteringCostSettings:
    modes: tuple[str, ...] = ("full", "first-token")
    output_tokens: tuple[int, ...] = (1, 512)
    requests: int = 32
    concurrency: int = 16
    replicas: int = 4
    predictors: int = 2
    scrape_interval_s: float = 0.5
    idle_s: float = 6.0
    prompt_words: int = 0
    """Words of filler after the question, each prompt its own (the request's number first);
    0: the short question alone. 232 words make ~1,000 tokens of the simulator's tokenizer."""
    slo_every: int = 0
    """One request in this many carries ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``; 0: none."""


SLO_HEADERS = {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "100"}


def _prompt(number: int, words: int) -> str:
    """Request ``number``'s prompt: the question, then ``words`` words of filler."""
    filler = " ".join(f"word{i}" for i in range(words))
    return f"Request {number}. Tell me about routers. {filler}".rstrip()


def _stream(
    client: httpx.Client,
    url: str,
    tokens: int,
    prompt: str = "Tell me about routers.",
    headers: dict | None = None,
) -> int:
    """One streamed chat answer of ``tokens`` tokens, read whole; returns its SSE data lines."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        return sum(line.startswith("data: ") for line in response.iter_lines())


def _cell(stack: LocalStack, url: str, tokens: int, settings: MeteringCostSettings, idle_rate: float) -> dict:
    assert stack.epp is not None and stack.envoy is not None
    epp, envoy = stack.epp.process.pid, stack.envoy.process.pid
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=settings.concurrency)) as client:
        epp_before, envoy_before, started = task_cpu_seconds(epp), task_cpu_seconds(envoy), time.monotonic()

        def one(i: int) -> int:
            slo = settings.slo_every > 0 and i % settings.slo_every == 0
            return _stream(
                client, url, tokens, _prompt(i, settings.prompt_words), SLO_HEADERS if slo else None
            )

        with ThreadPoolExecutor(settings.concurrency) as pool:
            lines = list(pool.map(one, range(settings.requests)))
        time.sleep(0.3)  # the last access-log batch (flushed every 0.1 s) reaches the EPP
        wall = time.monotonic() - started
        epp_cpu, envoy_cpu = task_cpu_seconds(epp) - epp_before, task_cpu_seconds(envoy) - envoy_before
    assert all(n >= tokens for n in lines), "an answer came back short"
    return {
        "tokens": tokens,
        "chunks": sum(lines) / len(lines),
        "wall_s": wall,
        "epp_ms": (epp_cpu - idle_rate * wall) / settings.requests * 1e3,
        "envoy_ms": envoy_cpu / settings.requests * 1e3,
    }


def measure(mode: str, settings: MeteringCostSettings) -> dict[str, Any]:
    """One metering ``mode``'s stack: its EPP idle rate and a cell per output length."""
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            predictors=settings.predictors,
            ports=StackPorts.free(),
            response_metering=mode,  # type: ignore[arg-type]
            epp_args=["--log-level", "WARNING", "--scrape-interval-s", str(settings.scrape_interval_s)],
        )
    )
    try:
        stack.start()
        assert stack.epp is not None
        url = f"{stack.gateway_url}/v1/chat/completions"
        with httpx.Client(timeout=60) as client:  # warm-up, and the model's calibration streams
            for _ in range(CALIBRATION_STREAMS + 2):
                _stream(client, url, 32)
        time.sleep(1.0)
        before = task_cpu_seconds(stack.epp.process.pid)
        time.sleep(settings.idle_s)
        idle_rate = (task_cpu_seconds(stack.epp.process.pid) - before) / settings.idle_s
        cells = [_cell(stack, url, n, settings, idle_rate) for n in settings.output_tokens]
        return {"mode": mode, "idle_ms_per_s": idle_rate * 1e3, "cells": cells}
    finally:
        stack.stop()


def shipped(full: dict[str, Any], first_token: dict[str, Any], sample_every: int) -> list[dict[str, Any]]:
    """The mean per request over all streams when one in ``sample_every`` is read to its end."""
    share = 1 / sample_every
    return [
        {
            "tokens": f["tokens"],
            "epp_ms": (1 - share) * t["epp_ms"] + share * f["epp_ms"],
            "envoy_ms": (1 - share) * t["envoy_ms"] + share * f["envoy_ms"],
        }
        for f, t in zip(full["cells"], first_token["cells"], strict=True)
    ]


def _ratio(cells: Sequence[dict[str, Any]], key: str) -> float:
    return cells[-1][key] / cells[0][key] if cells[0][key] > 0 else float("nan")


def _rows(data: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    by_mode = {r["mode"]: r["cells"] for r in data["results"]}
    rows = [(mode, cells) for mode, cells in by_mode.items()]
    if "shipped" in data:
        rows.append((f"first-token, 1 in {data['sample_every']} read whole (shipped)", data["shipped"]))
    return rows


def _markdown(data: dict[str, Any]) -> str:
    table = [
        [
            name,
            c["tokens"],
            f"{c['epp_ms']:.2f}",
            f"{c['envoy_ms']:.2f}",
            f"{c['epp_ms'] + c['envoy_ms']:.2f}",
        ]
        for name, cells in _rows(data)
        for c in cells
    ]
    ratios = [
        [name, f"{_ratio(cells, 'epp_ms'):.2f}×", f"{_ratio(cells, 'envoy_ms'):.2f}×"]
        for name, cells in _rows(data)
    ]
    s = data["settings"]
    tokens = s["output_tokens"]
    return "\n\n".join(
        [
            "# A streamed answer's cost by response metering",
            f"{s['requests']} streamed chat answers per cell, {s['concurrency']} at a time, through the "
            f"`make run` stack ({s['replicas']} simulated replicas, predicted-latency); EPP CPU net of "
            "its idle rate ("
            + ", ".join(f"{r['mode']} {r['idle_ms_per_s']:.1f} ms/s" for r in data["results"])
            + f", engines scraped every {s['scrape_interval_s']} s).",
            markdown_table(["metering", "output tokens", "EPP ms", "Envoy ms", "EPP + Envoy ms"], table),
            f"{tokens[-1]} tokens against {tokens[0]}:",
            markdown_table(["metering", "EPP", "Envoy"], ratios),
        ]
    )


def _plot(data: dict[str, Any], out_dir: Path) -> str:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = _rows(data)
    for axis, key, title in ((axes[0], "epp_ms", "EPP"), (axes[1], "envoy_ms", "Envoy")):
        width = 0.8 / len(rows)
        for i, (name, cells) in enumerate(rows):
            xs = [j + i * width for j in range(len(cells))]
            axis.bar(xs, [c[key] for c in cells], width, label=name)
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(rows[0][1]))])
        axis.set_xticklabels([f"{c['tokens']} tokens" for c in rows[0][1]])
        axis.set_yscale("log")
        axis.set_ylabel("CPU ms per streamed answer")
        axis.set_title(title)
    axes[0].legend(fontsize=7)
    return save_figure(figure, out_dir, "metering.png")


def run(out_dir: Path, settings: MeteringCostSettings | None = None) -> dict[str, Any]:
    settings = settings or MeteringCostSettings()
    results = [measure(mode, settings) for mode in settings.modes]
    data: dict[str, Any] = {"machine": machine(), "settings": asdict(settings), "results": results}
    by_mode = {r["mode"]: r for r in results}
    if {"full", "first-token"} <= by_mode.keys():
        data["sample_every"] = SHIPPED_SAMPLE_EVERY
        data["shipped"] = shipped(by_mode["full"], by_mode["first-token"], SHIPPED_SAMPLE_EVERY)
    out_dir.mkdir(parents=True, exist_ok=True)
    data["plot"] = _plot(data, out_dir)
    write_results(out_dir, "metering", data, _markdown(data))
    return data
