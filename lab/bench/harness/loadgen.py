"""Closed-loop HTTP load: N workers each send the next request as soon as the last one ends."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    duration_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.latencies_s)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s else float("nan")

    def merge(self, other: LoadResult) -> LoadResult:
        return LoadResult(
            self.latencies_s + other.latencies_s,
            self.statuses + other.statuses,
            self.duration_s + other.duration_s,
        )

    def summary(self) -> dict[str, float | int | dict[str, int]]:
        return {
            "requests": self.requests,
            "rps": round(self.rps, 1),
            "p50_ms": round(self.percentile_ms(50), 3),
            "p90_ms": round(self.percentile_ms(90), 3),
            "p99_ms": round(self.percentile_ms(99), 3),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
        }


async def closed_loop(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.5,
    content_type: str = "application/json",
) -> LoadResult:
    """POST ``body`` to ``url`` from ``concurrency`` workers; measure after ``warmup_s``."""
    result = LoadResult()
    headers = {"content-type": content_type}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        measure_from = start + warmup_s
        stop_at = measure_from + duration_s

        async def worker() -> None:
            while (now := time.perf_counter()) < stop_at:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    status = response.status
                end = time.perf_counter()
                if now >= measure_from:
                    result.latencies_s.append(end - now)
                    result.statuses[status] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.duration_s = time.perf_counter() - measure_from
    return result
