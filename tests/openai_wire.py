"""Helpers to compare OpenAI-style HTTP bodies by layout: shared by the simulator's tests and the
conformance suite."""

from __future__ import annotations

import json
from typing import Any


def sse_payloads(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, and "[DONE]"."""
    payloads = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def shape(value: Any) -> Any:
    """Keys (in order) and value types of a JSON document, to compare layouts, not values."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__
