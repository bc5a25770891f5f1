"""The EPP's per-request parse, tokenize and hash cost on long chat turns, with and without the
tokenizer cache (``epp.tokenizer.cache``), in this process.

Conversations are shaped like a coding agent's: a system prompt, then turns of tool output
(source files of this repository) and short assistant replies, until the rendered prompt holds
``prompt_tokens`` tokens. Each case times, per request, ``parse_openai_request`` (JSON, chat
template, tokenization) and the block hashes of the approximate (xxh64, 64-token blocks) and
precise (vLLM SHA-256, 32-token blocks) prefix producers, in CPU time of this process (the
tokenizer's own threads included) and wall time:

* **first seen**: a conversation no earlier request shares text with;
* **extension**: the next turn of a conversation whose previous turn was just parsed (a few
  hundred tokens added: the assistant's reply and the next tool output);
* **interleaved sessions**: 1, 3 and 8 such conversations growing side by side, one request of
  each in turn, from the system prompt to ``session_tokens`` tokens, with the cache: CPU per
  request against the prompt's length, which should stay flat however many sessions take turns
  (each must find its own previous prompt among the others').

``parse`` is the whole of ``parse_openai_request`` (JSON, chat template, tokenization); the chat
template's share is timed on its own as well.

Each runs ``without cache`` (the EPP before the cache: every prompt tokenized and hashed whole)
and ``with cache``. The tokenizer's own BPE word cache is warmed first, as in a running EPP.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from epp.plugins.precise_prefix_cache import PrecisePrefixCacheProducer, PrecisePrefixParameters
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer, ApproximatePrefixParameters
from epp.requestcontrol.openai_request import parse_openai_request
from epp.scheduling.framework import PluginContext
from epp.scheduling.types import LLMRequest
from epp.tokenizer.model import ModelTokenizer
from sim.measure.report import machine, markdown_table, write_results
from sim.models import TINY_MODEL_DIR

REPO = Path(__file__).resolve().parents[3]
CHAT_PATH = "/v1/chat/completions"
CACHE_BYTES = 256 << 20


@dataclass
class TokenizeBenchSettings:
    prompt_tokens: int = 26_000
    repeats: int = 15
    tool_output_chars: int = 900
    reply_chars: int = 300
    session_counts: tuple[int, ...] = (1, 3, 8)
    session_tokens: int = 30_000


def _source_text() -> str:
    dirs = ("epp", "lab/sim", "lab/bench", "predictor", "trainer")
    files = sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))
    return "".join(p.read_text() for p in files)


class Conversations:
    """Distinct agent-like conversations cut from one long source text."""

    def __init__(self, settings: TokenizeBenchSettings, tokenizer: ModelTokenizer) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.source = _source_text()
        if len(self.source) < settings.tool_output_chars + settings.reply_chars:
            raise RuntimeError(f"too little source text under {REPO} to build conversations from")
        self.offset = 0

    def _take(self, chars: int) -> str:
        if self.offset + chars > len(self.source):
            self.offset = 0
        piece = self.source[self.offset : self.offset + chars]
        self.offset += chars
        return piece

    @staticmethod
    def start(session: int) -> list[dict[str, str]]:
        """A conversation's first message: its system prompt, distinct per session."""
        return [
            {"role": "system", "content": f"Session {session}. You are a coding agent working here. " * 20}
        ]

    def new(self, session: int) -> list[dict[str, str]]:
        """A conversation of about ``prompt_tokens`` tokens, ending with tool output."""
        messages = self.start(session)
        target = self.settings.prompt_tokens
        while (tokens := len(self.tokenizer.encode_chat(messages))) < target:
            # Add the turns the missing tokens need at this conversation's characters per token.
            chars = sum(len(m["content"]) for m in messages)
            missing = (target - tokens) * chars / tokens
            while missing > 0:
                self.extend(messages)
                missing -= len(messages[-1]["content"]) + len(messages[-2]["content"])
        return messages

    def extend(self, messages: list[dict[str, str]]) -> None:
        """The next turn: the assistant's reply to the last tool output, and the next tool output."""
        s = self.settings
        messages.append({"role": "assistant", "content": self._take(s.reply_chars)})
        messages.append({"role": "user", "content": self._take(s.tool_output_chars)})


def _body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 64}).encode()


class _Pipeline:
    """What the EPP does with a chat body before scoring: parse and tokenize, then hash the blocks."""

    def __init__(self, cache_bytes: int) -> None:
        self.tokenizer = ModelTokenizer(TINY_MODEL_DIR, cache_bytes=cache_bytes)
        context = PluginContext(clock=time.monotonic)
        self.approximate = ApproximatePrefixCacheProducer("a", ApproximatePrefixParameters(), context)
        self.precise = PrecisePrefixCacheProducer("p", PrecisePrefixParameters(), context)

    def parse(self, body: bytes) -> LLMRequest:
        return parse_openai_request(CHAT_PATH, {}, body, self.tokenizer, "bench")

    def hash(self, request: LLMRequest) -> None:
        self.approximate.block_hashes(request)
        self.precise.block_hashes(request)


def _timed(call: Callable[[], Any]) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = call()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def _request_cost(pipeline: _Pipeline, messages: list[dict[str, str]]) -> dict[str, float]:
    body = _body(messages)
    _, render_cpu, _ = _timed(lambda: pipeline.tokenizer.render_chat(messages))  # a part of parsing
    request, parse_cpu, parse_wall = _timed(lambda: pipeline.parse(body))
    _, hash_cpu, hash_wall = _timed(lambda: pipeline.hash(request))
    return {
        "parse_cpu": parse_cpu,
        "render_cpu": render_cpu,
        "hash_cpu": hash_cpu,
        "total_cpu": parse_cpu + hash_cpu,
        "total_wall": parse_wall + hash_wall,
        "tokens": request.input_tokens,
    }


def _summary(samples: list[dict[str, float]]) -> dict[str, float]:
    times = [k for k in samples[0] if k not in ("tokens", "new_tokens")]
    out = {f"{k}_ms": round(statistics.median(s[k] for s in samples) * 1e3, 2) for k in times}
    out["prompt_tokens"] = round(statistics.median(s["tokens"] for s in samples))
    out["new_tokens"] = round(statistics.median(s["new_tokens"] for s in samples))
    return out


class _Case:
    """One case and arm: its pipeline and conversations, sampled a request at a time."""

    def __init__(self, settings: TokenizeBenchSettings, cache_bytes: int, extension: bool) -> None:
        self.pipeline, self.extension = _Pipeline(cache_bytes), extension
        self.conversations = Conversations(settings, ModelTokenizer(TINY_MODEL_DIR))
        warm = self.conversations.new(session=-1)  # warms the BPE word cache, as a running EPP's is
        self.pipeline.hash(self.pipeline.parse(_body(warm)))
        self.samples: list[dict[str, float]] = []

    def sample(self, session: int) -> None:
        messages = self.conversations.new(session)
        seen = 0
        if self.extension:
            before = self.pipeline.parse(_body(messages))  # the turn before: seen
            self.pipeline.hash(before)
            seen = before.input_tokens
            self.conversations.extend(messages)
        sample = _request_cost(self.pipeline, messages)
        self.samples.append({**sample, "new_tokens": sample["tokens"] - seen})

    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = _summary(self.samples)
        if (cache := self.pipeline.tokenizer.cache) is not None:
            stats = cache.stats()
            result["cache"] = {"hits": stats.hits, "misses": stats.misses, "fallbacks": stats.fallbacks}
        return result


# Prompt-length bands the interleaved sessions' requests are summarised in.
SESSION_BANDS = ((0, 8_000), (8_000, 16_000), (16_000, 24_000), (24_000, None))


def interleaved_sessions(settings: TokenizeBenchSettings, sessions: int) -> dict[str, Any]:
    """``sessions`` conversations growing in turns to ``session_tokens`` tokens, with the cache:
    each request's cost and, at the end, whether every last prompt's ids are a full tokenization's."""
    pipeline, plain = _Pipeline(CACHE_BYTES), ModelTokenizer(TINY_MODEL_DIR)
    conversations = Conversations(settings, plain)
    chats = [conversations.start(session) for session in range(sessions)]
    requests: list[dict[str, Any]] = []
    for turn in itertools.count():
        for session, messages in enumerate(chats):
            conversations.extend(messages)
            requests.append({"turn": turn, "session": session, **_request_cost(pipeline, messages)})
        if requests[-1]["tokens"] >= settings.session_tokens:
            break
    assert pipeline.tokenizer.cache is not None
    stats = pipeline.tokenizer.cache.stats()  # before the check below adds its own hits
    identical = all(pipeline.tokenizer.encode_chat(m) == plain.encode_chat(m) for m in chats)
    return {
        "sessions": sessions,
        "bands": [_band(requests, lo, hi) for lo, hi in SESSION_BANDS],
        "requests": [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in requests],
        "cache": {k: getattr(stats, k) for k in ("hits", "misses", "fallbacks", "entries", "bytes")},
        "identical": identical,
    }


def _band(requests: list[dict[str, Any]], lo: int, hi: int | None) -> dict[str, Any]:
    """Median CPU per request (total, and its tokenize-and-hash part) of prompts of ``lo``–``hi`` tokens."""
    inside = [r for r in requests if r["tokens"] >= lo and (hi is None or r["tokens"] < hi)]
    median = {
        k: round(statistics.median(r[k] for r in inside) * 1e3, 2) if inside else None
        for k in ("total_cpu", "parse_cpu", "hash_cpu")
    }
    return {"tokens": f"{lo // 1000}k–{f'{hi // 1000}k' if hi else ''}", "requests": len(inside), **median}


def check_identical(settings: TokenizeBenchSettings) -> bool:
    """The cached pipeline gives the same ids and hashes as the uncached one on an extension."""
    cached, plain = _Pipeline(CACHE_BYTES), _Pipeline(0)
    conversations = Conversations(settings, plain.tokenizer)
    messages = conversations.new(session=0)
    cached.parse(_body(messages))
    conversations.extend(messages)
    a, b = cached.parse(_body(messages)), plain.parse(_body(messages))
    return a.prompt_token_ids == b.prompt_token_ids and all(
        producer(a) == producer(b)
        for producer in (cached.approximate.block_hashes, cached.precise.block_hashes)
    )


CASES = [
    ("first seen", "without cache", 0, False),
    ("first seen", "with cache", CACHE_BYTES, False),
    ("extension", "without cache", 0, True),
    ("extension", "with cache", CACHE_BYTES, True),
]


def _plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{c['case']}\n{c['arm']}" for c in data["cases"]]
    parse = [c["parse_cpu_ms"] for c in data["cases"]]
    hashed = [c["hash_cpu_ms"] for c in data["cases"]]
    ax.bar(labels, parse, label="parse + tokenize", color="#47a")
    ax.bar(labels, hashed, bottom=parse, label="block hashes", color="#4a7")
    ax.set_ylabel("CPU ms per request (median)")
    ax.set_title(f"{data['settings']['prompt_tokens']:,}-token chat turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_sessions(data: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    for case in data["sessions"]:
        requests = case["requests"]
        tokens = [r["tokens"] for r in requests]
        ax.plot(tokens, [r["total_cpu"] * 1e3 for r in requests], ".", ms=3, label=f"{case['sessions']}")
    ax.set_xlabel("prompt tokens (each request extends its session's previous prompt)")
    ax.set_ylabel("CPU ms per request")
    ax.set_ylim(bottom=0)
    ax.set_title("Interleaved growing sessions, with the tokenizer cache")
    ax.legend(title="sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sessions_markdown(data: dict[str, Any]) -> list[str]:
    cases = data["sessions"]
    headers = [
        "sessions",
        *(f"{band['tokens']} tokens" for band in cases[0]["bands"]),
        "cache hits / misses / fallbacks",
        "identical",
    ]
    rows = [
        [
            case["sessions"],
            *(f"{b['total_cpu']} ({b['parse_cpu']} + {b['hash_cpu']})" for b in case["bands"]),
            "{hits} / {misses} / {fallbacks}".format(**case["cache"]),
            case["identical"],
        ]
        for case in cases
    ]
    return [
        "## Interleaved growing sessions",
        f"Sessions take turns, one request each, each growing to {data['settings']['session_tokens']:,} "
        "tokens; with the cache. Median CPU ms per request in each band of prompt length "
        "(parse + tokenize, block hashes).",
        markdown_table(headers, rows),
        "![sessions](tokenize-sessions.png)",
    ]


def _markdown(data: dict[str, Any]) -> str:
    host, s = data["machine"], data["settings"]
    columns = ("parse_cpu_ms", "render_cpu_ms", "hash_cpu_ms", "total_cpu_ms", "total_wall_ms")
    rows = [
        [c["case"], c["arm"], f"{c['prompt_tokens']:,}", f"{c['new_tokens']:,}", *(c[k] for k in columns)]
        for c in data["cases"]
    ]
    return "\n\n".join(
        [
            "# Parse, tokenize and hash: long chat turns, with and without the tokenizer cache",
            f"Machine: {host['cpus']} CPUs, Python {host['python']}, {host['date']}. "
            f"Median of {s['repeats']} requests per case, in this process "
            "(`llm-epp-bench tokenize`).",
            markdown_table(
                [
                    "case",
                    "arm",
                    "prompt tokens",
                    "new tokens",
                    "parse CPU ms",
                    "of which chat template",
                    "hash CPU ms",
                    "CPU ms",
                    "wall ms",
                ],
                rows,
            ),
            f"Cached and uncached ids and hashes identical: {data['identical']}.",
            "![tokenize](tokenize.png)",
            *_sessions_markdown(data),
        ]
    )


def run(out_dir: Path, settings: TokenizeBenchSettings | None = None) -> dict[str, Any]:
    settings = settings or TokenizeBenchSettings()
    cases = {(case, arm): _Case(settings, cache_bytes, extends) for case, arm, cache_bytes, extends in CASES}
    for session in range(settings.repeats):  # the arms take turns, so that drift affects them alike
        for case in cases.values():
            case.sample(session)
    data = {
        "machine": machine(),
        "settings": asdict(settings),
        "cases": [{"case": case, "arm": arm, **c.result()} for (case, arm), c in cases.items()],
        "identical": check_identical(settings),
        "sessions": [interleaved_sessions(settings, n) for n in settings.session_counts],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(data, out_dir / "tokenize.png")
    _plot_sessions(data, out_dir / "tokenize-sessions.png")
    write_results(out_dir, "tokenize", data, _markdown(data))
    return data
