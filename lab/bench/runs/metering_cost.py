"""What a streamed answer costs the EPP and Envoy under each response metering.

The ``make run`` stack (simulated replicas, predicted-latency with its trainer and predictors),
once per ``--response-metering``: ``full`` (every chunk of the answer crosses ext_proc) and
``first-token`` (the EPP reads to the first token, then Envoy's access log finishes the request).
In each: ``requests`` streamed chat answers of 1 and of 512 tokens (``ignore_eos``), sent at
the same even pace in both cells (over ``arrival_span_s``) and measured over the same window
(``window_s``), so that what the EPP does per second while busy (training-sample batches,
access-log batches, the trainer's and predictors' polls) weighs the same on both; the EPP's CPU
per request net of its idle rate, and Envoy's CPU per request.

Then the accuracy of what the EPP learns from each metering: ``accuracy_requests`` streamed
answers of varied prompts and lengths, ``accuracy_concurrency`` at a time; the output tokens
the EPP counted against the client's, and the live TTFT and TPOT MAPE of the newest latency
model (``llm_epp_prediction_mape``).

The first-token run sends each model's calibration streams first, so its figures are those of
handed-off streams. With the shipped sampling one stream in N is still read to its end, at the
full run's cost, so the mean over all requests is ``(1 - 1/N) × first-token + 1/N × full``: the
``shipped`` rows. The EPPs scrape their engines every ``scrape_interval_s`` here (5 s, not
``make run``'s 50 ms): a busy engine's scrape is parsed anew each time (an idle one's is not),
a cost per second of the pool's, not per request, which over a long answer's seconds would
otherwise be charged to the answer; scrapes are measured on their own (``llm-epp-bench
idle``, ``capacity``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib.pyplot as plt

from bench.harness.process_cpu import idle_cpu_rate, rare_scrape_args, task_cpu_seconds
from epp.settings import EppSettings
from sim.measure.prometheus_samples import Samples, scrape, total
from sim.measure.report import machine, markdown_table, save_figure, write_results
from sim.stack import LocalStack, StackConfig, StackPorts

SHIPPED_SAMPLE_EVERY: int = EppSettings.model_fields["metering_sample_every"].default
OUTPUT_TOKENS = "inference_objective_output_tokens_sum"
CALIBRATION_STREAMS: int = EppSettings.model_fields["metering_calibration_streams"].default


@dataclass
class MeteringCostSettings:
    modes: tuple[str, ...] = ("full", "first-token")
    output_tokens: tuple[int, ...] = (1, 512)
    requests: int = 32
    arrival_span_s: float = 6.0
    window_s: float = 12.0
    """From the first arrival; the longest answer (512 tokens, ~3.5 s) ends well before it."""
    replicas: int = 4
    predictors: int = 2
    scrape_interval_s: float = 5.0
    idle_s: float = 6.0
    accuracy_requests: int = 240
    accuracy_concurrency: int = 8
    seed: int = 0
    prompt_words: int = 0
    """Words of filler after the cells' question, each prompt its own (the request's number
    first); 0: the short question alone. 232 words make ~1,000 tokens of the simulator's
    tokenizer."""
    slo_every: int = 0
    """One request of the cells in this many carries ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``;
    0: none."""
    plain_tokens: int = 16
    """A cell of non-streamed answers this long, paced like the others (0: none): first-token
    metering ends their ext_proc stream at the routing."""


SLO_HEADERS = {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "100"}


def _prompt(number: int, words: int) -> str:
    """Request ``number``'s prompt: the question, then ``words`` words of filler."""
    if words == 0:
        return "Tell me about routers."
    filler = " ".join(f"word{i}" for i in range(words))
    return f"Request {number}. Tell me about routers. {filler}"


def _answer(
    client: httpx.Client,
    url: str,
    tokens: int,
    prompt: str = "Tell me about routers.",
    headers: dict[str, str] | None = None,
    *,
    stream: bool = True,
) -> int:
    """One chat answer of exactly ``tokens`` tokens: streamed and read whole (returns its SSE data
    lines), or not (returns its completion tokens)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    if not stream:
        response = client.post(url, json=body, headers=headers)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        return sum(line.startswith("data: ") for line in response.iter_lines())


def newest_mape(samples: Samples) -> dict[str, float]:
    """Each target's rolling MAPE of the newest model version that has one."""
    newest: dict[str, tuple[int, float]] = {}
    for (name, labels), value in samples.items():
        if name != "llm_epp_prediction_mape":
            continue
        label = dict(labels)
        target, version = label["target"], int(label["model_version"])
        if version >= newest.get(target, (-1, 0.0))[0]:
            newest[target] = (version, value)
    return {target: mape for target, (_, mape) in newest.items()}


def _accuracy(stack: LocalStack, url: str, settings: MeteringCostSettings) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    plan = [
        (rng.randint(16, 384), f"request {i}: " + "tell me about routers and queues " * rng.randint(2, 60))
        for i in range(settings.accuracy_requests)
    ]
    metrics_url = stack.epp_metrics_url
    counted_before = total(scrape(metrics_url), OUTPUT_TOKENS)
    concurrency = settings.accuracy_concurrency
    limits = httpx.Limits(max_connections=concurrency)
    with httpx.Client(timeout=120, limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: _answer(client, url, *p), plan))
    time.sleep(1.0)  # the last access-log entries
    samples = scrape(metrics_url)
    counted = total(samples, OUTPUT_TOKENS) - counted_before
    return {
        "requests": len(plan),
        "output_tokens": sum(tokens for tokens, _ in plan),
        "output_tokens_counted": counted,
        "mape": newest_mape(samples),
    }


def _cell(
    stack: LocalStack,
    url: str,
    tokens: int,
    settings: MeteringCostSettings,
    idle_rate: float,
    stream: bool = True,
) -> dict:
    """``settings.requests`` answers of ``tokens`` tokens (streamed, or not), paced evenly; the
    EPP's CPU per request net of ``idle_rate``, and Envoy's."""
    assert stack.epp is not None and stack.envoy is not None
    epp, envoy = stack.epp.process.pid, stack.envoy.process.pid
    gap = settings.arrival_span_s / settings.requests

    def paced(i: int) -> int:
        time.sleep(max(0.0, started + i * gap - time.monotonic()))
        slo = settings.slo_every > 0 and i % settings.slo_every == 0
        return _answer(
            client,
            url,
            tokens,
            _prompt(i, settings.prompt_words),
            SLO_HEADERS if slo else None,
            stream=stream,
        )

    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=settings.requests)) as client:
        epp_before, envoy_before, started = task_cpu_seconds(epp), task_cpu_seconds(envoy), time.monotonic()
        with ThreadPoolExecutor(settings.requests) as pool:
            lines = list(pool.map(paced, range(settings.requests)))
        left = started + settings.window_s - time.monotonic()
        assert left > 0.3, "the answers outlasted the window: raise window_s"
        time.sleep(left)  # the same window for every cell; the last access-log batch is in
        epp_cpu, envoy_cpu = task_cpu_seconds(epp) - epp_before, task_cpu_seconds(envoy) - envoy_before
    assert all(n >= tokens for n in lines), "an answer came back short"
    return {
        "tokens": tokens,
        "chunks": sum(lines) / len(lines),
        "window_s": settings.window_s,
        "epp_ms": (epp_cpu - idle_rate * settings.window_s) / settings.requests * 1e3,
        "envoy_ms": envoy_cpu / settings.requests * 1e3,
    }


def measure(mode: str, settings: MeteringCostSettings) -> dict[str, Any]:
    """One metering ``mode``'s stack: its EPP idle rate, a cell per output length, and what the
    EPP learned (``accuracy``)."""
    stack = LocalStack(
        StackConfig(
            replicas=settings.replicas,
            predictors=settings.predictors,
            ports=StackPorts.free(),
            response_metering=mode,  # type: ignore[arg-type]
            epp_args=rare_scrape_args(settings.scrape_interval_s),
        )
    )
    try:
        stack.start()
        assert stack.epp is not None
        url = f"{stack.gateway_url}/v1/chat/completions"
        with httpx.Client(timeout=60) as client:  # warm-up, and the model's calibration streams
            for _ in range(CALIBRATION_STREAMS + 2):
                _answer(client, url, 32)
        time.sleep(1.0)
        idle_rate = idle_cpu_rate(stack.epp.process.pid, settings.idle_s)
        cells = [_cell(stack, url, n, settings, idle_rate) for n in settings.output_tokens]
        plain = (
            _cell(stack, url, settings.plain_tokens, settings, idle_rate, stream=False)
            if settings.plain_tokens
            else None
        )
        accuracy = _accuracy(stack, url, settings)
        return {
            "mode": mode,
            "idle_ms_per_s": idle_rate * 1e3,
            "cells": cells,
            "plain": plain,
            "accuracy": accuracy,
        }
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
    accuracy = [
        [
            r["mode"],
            f"{r['accuracy']['output_tokens_counted']:.0f} / {r['accuracy']['output_tokens']}",
            f"{r['accuracy']['mape'].get('ttft', float('nan')):.3f}",
            f"{r['accuracy']['mape'].get('tpot', float('nan')):.3f}",
        ]
        for r in data["results"]
    ]
    plain = [
        [r["mode"], f"{r['plain']['epp_ms']:.2f}", f"{r['plain']['envoy_ms']:.2f}"]
        for r in data["results"]
        if r.get("plain")
    ]
    s = data["settings"]
    tokens = s["output_tokens"]
    return "\n\n".join(
        [
            "# A streamed answer's cost by response metering",
            f"{s['requests']} streamed chat answers per cell, sent evenly over {s['arrival_span_s']} s and "
            f"measured over {s['window_s']} s, through the "
            f"`make run` stack ({s['replicas']} simulated replicas, predicted-latency); EPP CPU net of "
            "its idle rate ("
            + ", ".join(f"{r['mode']} {r['idle_ms_per_s']:.1f} ms/s" for r in data["results"])
            + f", engines scraped every {s['scrape_interval_s']} s).",
            markdown_table(["metering", "output tokens", "EPP ms", "Envoy ms", "EPP + Envoy ms"], table),
            f"{tokens[-1]} tokens against {tokens[0]}:",
            markdown_table(["metering", "EPP", "Envoy"], ratios),
            f"What the EPP learned from {s['accuracy_requests']} answers of 16–384 tokens "
            f"({s['accuracy_concurrency']} at a time): output tokens it counted against those sent, "
            "and the live MAPE of the newest latency model:",
            markdown_table(["metering", "output tokens counted / sent", "TTFT MAPE", "TPOT MAPE"], accuracy),
            f"Non-streamed answers of {s['plain_tokens']} tokens, paced and measured like the cells above:",
            markdown_table(["metering", "EPP ms", "Envoy ms"], plain),
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
