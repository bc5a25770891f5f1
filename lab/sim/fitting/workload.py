"""A seeded mix of streamed completions with Poisson arrivals, replayed open-loop against a server.

The same seed gives the same prompts (texts), output lengths and arrival times, so two servers
can be given exactly the same work. Open loop: each request is sent at its arrival time whether
or not earlier ones have finished, as independent users would.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from sim.fitting.completions import CompletionError, PromptMaker, StreamedCompletion, stream_completion


@dataclass(frozen=True, slots=True)
class WorkItem:
    arrival_s: float
    """Seconds after the start of the replay."""
    prompt: str
    prompt_tokens: int
    output_tokens: int


def poisson_workload(
    *,
    rate: float,
    count: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
) -> list[WorkItem]:
    """``count`` requests at ``rate`` per second on average; lengths uniform within the inclusive
    ranges (tokens of the tiny model)."""
    rng = random.Random(seed)
    prompts = PromptMaker(seed)
    items, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        length = rng.randint(*prompt_tokens)
        items.append(WorkItem(now, prompts.text(length), length, rng.randint(*output_tokens)))
    return items


@dataclass(frozen=True, slots=True)
class Replay:
    completions: list[StreamedCompletion]
    errors: list[str]
    duration_s: float


async def replay(
    base_url: str, items: Sequence[WorkItem], on_done: Callable[[], None] = lambda: None
) -> Replay:
    """Send every item at its arrival time, stream all responses to the end."""
    completions: list[StreamedCompletion] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)  # one connection per in-flight request, as users
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(item: WorkItem) -> None:
            try:
                completions.append(
                    await stream_completion(session, base_url, item.prompt, item.output_tokens)
                )
            except (CompletionError, aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            on_done()

        start = time.perf_counter()
        tasks = []
        for item in items:
            await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)
        return Replay(completions, errors, time.perf_counter() - start)
