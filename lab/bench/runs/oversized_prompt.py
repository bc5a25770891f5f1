"""Oversized prompts: the EPP's CPU to refuse a 10 MiB prompt that cannot fit the model's context.

1. **In process.** ``parse_openai_request`` (orjson decode and the context-window checks) on the
   body as Envoy delivers it, timed with ``time.process_time``: completions and chat, at contexts
   of 2,048, 32,768 and 131,072 tokens (the tiny model's longest token is 37 characters, so each
   refuses 10 MiB untokenized); a prompt just under the character bound of the 32,768-token
   context, refused from a prefix; and, for reference, tokenizing the whole 10 MiB prompt (what
   the EPP did before it knew the context).
2. **Through Envoy.** The EPP process's CPU per 10 MiB request through real Envoy to a simulated
   engine (32,768-token context, learned from its ``/v1/models``), net of idle scraping: this
   includes receiving the body over gRPC.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.progress import Progress

from bench.harness.rig import GatewayRig
from epp.errors import BadRequest
from epp.requestcontrol.openai_request import parse_openai_request
from epp.tokenizer.model import ModelTokenizer
from sim.measure.report import machine, markdown_table, write_results
from sim.models import TINY_MODEL_DIR

TEN_MIB = 10 << 20
WORDS = "hello world "  # 3 tokens in 12 characters


@dataclass
class OversizedPromptSettings:
    repeats: int = 5
    contexts: tuple[int, ...] = (2048, 32_768, 131_072)
    gateway_requests: int = 10


def _body(chat: bool, text: str) -> bytes:
    if chat:
        return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()
    return json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()


def _refusal_cpu_ms(path: str, body: bytes, tokenizer: ModelTokenizer, context: int, repeats: int) -> float:
    """Median CPU time, in ms, of parsing ``body`` into its refusal."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        try:
            parse_openai_request(path, {}, body, tokenizer, "bench", max_model_len=context)
        except BadRequest:
            times.append(time.process_time() - start)
        else:
            raise AssertionError("the prompt was not refused")
    return round(statistics.median(times) * 1e3, 2)


def measure_in_process(settings: OversizedPromptSettings) -> list[dict[str, Any]]:
    tokenizer = ModelTokenizer(TINY_MODEL_DIR)
    text = WORDS * (TEN_MIB // len(WORDS))
    rows = []
    for chat in (False, True):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = _body(chat, text)
        for context in settings.contexts:
            case = f"10 MiB {'chat message' if chat else 'prompt'}, {context}-token context"
            rows.append(
                {"case": case, "cpu_ms": _refusal_cpu_ms(path, body, tokenizer, context, settings.repeats)}
            )
    context = 32_768
    under_bound = WORDS * (context * tokenizer.max_chars_per_token // len(WORDS))
    case = f"{len(under_bound) / 2**20:.2f} MiB prompt (under the character bound), {context}-token context"
    cpu_ms = _refusal_cpu_ms(
        "/v1/completions", _body(False, under_bound), tokenizer, context, settings.repeats
    )
    rows.append({"case": case, "cpu_ms": cpu_ms})
    start = time.process_time()
    tokenizer.encode(text)
    rows.append(
        {
            "case": "reference: tokenizing the whole 10 MiB prompt",
            "cpu_ms": round((time.process_time() - start) * 1e3, 1),
        }
    )
    return rows


def measure_through_envoy(settings: OversizedPromptSettings) -> dict[str, Any]:
    body = _body(False, WORDS * (TEN_MIB // len(WORDS)))
    with GatewayRig(endpoints=1, engine="instant") as rig, httpx.Client(timeout=60) as client:
        assert rig.epp is not None
        url = rig.with_epp_url + "/v1/completions"
        headers = {"content-type": "application/json"}
        client.post(url, content=body, headers=headers)  # warm the connection and the context length
        idle_start, idle_cpu = time.perf_counter(), rig.epp.cpu_seconds()
        time.sleep(3.0)
        idle_rate = (rig.epp.cpu_seconds() - idle_cpu) / (time.perf_counter() - idle_start)
        start, cpu = time.perf_counter(), rig.epp.cpu_seconds()
        statuses = [
            client.post(url, content=body, headers=headers).status_code
            for _ in range(settings.gateway_requests)
        ]
        elapsed, used = time.perf_counter() - start, rig.epp.cpu_seconds() - cpu
    assert set(statuses) == {400}, statuses
    return {
        "requests": len(statuses),
        "epp_cpu_ms_per_request": round((used - idle_rate * elapsed) / len(statuses) * 1e3, 1),
        "wall_ms_per_request": round(elapsed / len(statuses) * 1e3, 1),
        "epp_idle_cpu_percent": round(idle_rate * 100, 1),
    }


def _plot(data: dict[str, Any], path: Path) -> None:
    rows = [
        *data["in_process"],
        {"case": "10 MiB prompt through Envoy", "cpu_ms": data["through_envoy"]["epp_cpu_ms_per_request"]},
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.barh([r["case"] for r in rows], [r["cpu_ms"] for r in rows], color="#47a")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.axvline(50, color="#a44", linestyle="--", label="50 ms")
    ax.set_xlabel("EPP CPU ms to refuse (log scale)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(data: dict[str, Any]) -> str:
    envoy = data["through_envoy"]
    return "\n\n".join(
        [
            "# Oversized prompts",
            "EPP CPU to refuse a prompt that cannot fit the context (`time.process_time`, median of "
            f"{data['settings']['repeats']}).",
            markdown_table(["case", "CPU ms"], [[r["case"], r["cpu_ms"]] for r in data["in_process"]]),
            f"Through real Envoy: **{envoy['epp_cpu_ms_per_request']} ms** of EPP CPU per 10 MiB request "
            f"({envoy['wall_ms_per_request']} ms wall, {envoy['requests']} requests, net of idle scraping "
            f"at {envoy['epp_idle_cpu_percent']}% of a core).",
        ]
    )


def run(out_dir: Path, settings: OversizedPromptSettings | None = None) -> dict[str, Any]:
    settings = settings or OversizedPromptSettings()
    with Progress() as progress:
        task = progress.add_task("oversized-prompt", total=2)
        in_process = measure_in_process(settings)
        progress.advance(task)
        through_envoy = measure_through_envoy(settings)
        progress.advance(task)
    data = {
        "machine": machine(),
        "settings": asdict(settings),
        "in_process": in_process,
        "through_envoy": through_envoy,
    }
    write_results(out_dir, "oversized-prompt", data, _markdown(data))
    _plot(data, out_dir / "oversized-prompt.png")
    return data
