"""Streamed completions through a stack with latency prediction, and a small, slow engine profile
for them: shared by the predicted-latency and drift integration tests."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from sim.engine import profiles
from sim.stack import LocalStack

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def small_engine_profile(path: Path, slowdown: float = 4.0) -> Path:
    """The default (Dynamo-polynomial) step times, scaled, on a deliberately small engine."""
    data = yaml.safe_load((Path(profiles.__file__).parent / "default.yaml").read_text())
    data["name"] = "small-test-engine"
    data["engine"].update({"max_num_seqs": 4, "num_gpu_blocks": 8000, "max_num_batched_tokens": 4096})
    for part in data["step_time_ms"].values():
        for term in part:
            part[term] *= slowdown
    path.write_text(yaml.safe_dump(data))
    return path


def prompt(i: int, words: int) -> str:
    return f"request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    text: str
    ttft_ms: float | None
    """Client-side time to the first event carrying generated text."""

    def json(self) -> dict:
        return json.loads(self.text)


def send(
    stack: LocalStack, i: int, words: int, max_tokens: int, headers: dict[str, str] | None = None
) -> Reply:
    body = {"model": "tiny", "prompt": prompt(i, words), "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started, ttft_ms, lines = time.perf_counter(), None, []
    with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", json=body, timeout=60,
                      headers={"x-llm-epp-debug": "true", **(headers or {})}) as response:  # fmt: skip
        for line in response.iter_lines():
            lines.append(line)
            if (
                ttft_ms is None
                and line.startswith("data: {")
                and '"text":"' in line
                and '"text":""' not in line
            ):
                ttft_ms = (time.perf_counter() - started) * 1e3
        return Reply(response.status_code, response.headers, "\n".join(lines), ttft_ms)


def model_version(stack: LocalStack) -> int:
    status = httpx.get(f"{stack.predictor_url(0)}/status", timeout=5).json()
    return int(status.get("model_version") or 0)
