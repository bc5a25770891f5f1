"""Read an engine's load out of its Prometheus ``/metrics`` text.

A vLLM scrape is ~700 lines (55 KB) of which the router needs four metrics. Parsing all of
it with ``prometheus_client``'s parser takes ~9 ms, too much at a 50 ms tick per endpoint,
so the wanted sample lines are located with ``bytes.find`` (~50 µs for all four) and only
the labels of ``vllm:cache_config_info`` go through the library parser, once per distinct
line.

Names follow vLLM 0.32 (``vllm:kv_cache_usage_perc``); the older
``vllm:gpu_cache_usage_perc`` is read when the new one is absent. Several samples of one
gauge (data-parallel engines behind one port) are summed for queue lengths and maxed for
KV usage.
"""

from __future__ import annotations

import math
from functools import lru_cache

from prometheus_client.parser import text_string_to_metric_families

from epp.scheduling.types import EngineMetrics

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"


class MetricsParseError(ValueError):
    """The scrape lacks the metrics the router needs."""


def _sample_lines(text: bytes, name: str) -> list[bytes]:
    """Every sample line of metric ``name`` (exact name, with or without labels).

    ``text`` must start with a newline, so the first line is found like the others.
    """
    needle = b"\n" + name.encode()
    lines: list[bytes] = []
    start = 0
    while (i := text.find(needle, start)) >= 0:
        after = i + len(needle)
        end = text.find(b"\n", after)
        end = len(text) if end < 0 else end
        if text[after : after + 1] in (b"{", b" ", b"\t"):
            lines.append(text[i + 1 : end])
        start = after
    return lines


def _sample_values(text: bytes, name: str) -> list[float]:
    values = []
    for line in _sample_lines(text, name):
        rest = line[line.rfind(b"}") + 1 :] if b"}" in line else line[len(name) :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            values.append(value)
    return values


@lru_cache(maxsize=256)
def _cache_config(line: bytes) -> tuple[int | None, int | None]:
    for family in text_string_to_metric_families(line.decode("utf-8", "replace") + "\n"):
        for sample in family.samples:
            labels = sample.labels
            try:
                block_size = int(labels["block_size"]) if "block_size" in labels else None
                blocks = int(labels["num_gpu_blocks"]) if "num_gpu_blocks" in labels else None
            except ValueError:
                return None, None
            return block_size, blocks
    return None, None


def parse_engine_metrics(text: bytes, now: float) -> EngineMetrics:
    """Extract queue, running and KV-usage figures; raise :class:`MetricsParseError` if absent."""
    text = b"\n" + text
    waiting = _sample_values(text, WAITING)
    running = _sample_values(text, RUNNING)
    kv = _sample_values(text, KV_USAGE) or _sample_values(text, KV_USAGE_LEGACY)
    if not waiting or not running or not kv:
        raise MetricsParseError(f"scrape lacks {WAITING}, {RUNNING} or {KV_USAGE}")
    cache_lines = _sample_lines(text, CACHE_CONFIG)
    block_size, num_blocks = _cache_config(cache_lines[0]) if cache_lines else (None, None)
    return EngineMetrics(
        waiting=int(sum(waiting)),
        running=int(sum(running)),
        kv_cache_usage=min(1.0, max(0.0, max(kv))),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        updated_at=now,
    )
