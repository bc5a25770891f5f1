"""CPU charged to the processes under a benchmark: per process from /proc, at rest, and the EPP
flags that keep its scraper's CPU apart from what requests cost."""

from __future__ import annotations

import time
from pathlib import Path


def task_cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid``, at nanosecond resolution."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between the listing and the read
    return total / 1e9


def rare_scrape_args(scrape_interval_s: float) -> list[str]:
    """EPP flags for a bench that charges CPU to requests: warnings only, and the engines
    scraped every ``scrape_interval_s`` (a cost per second of the pool's, measured apart), with
    a timeout long enough that a late scrape, the only sign of life for seconds, ejects nothing."""
    interval = str(scrape_interval_s)
    return [
        "--log-level",
        "WARNING",
        "--scrape-interval-s",
        interval,
        "--scrape-timeout-s",
        str(2 * scrape_interval_s),
    ]


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """``pid``'s CPU seconds per second over ``seconds`` of waiting."""
    before = task_cpu_seconds(pid)
    time.sleep(seconds)
    return (task_cpu_seconds(pid) - before) / seconds
