"""The in-process handler benchmark drives real routing decisions, not a short cut."""

from __future__ import annotations

import asyncio
import json

from bench.runs.handler_cpu import PROMPT, _messages, make_director, measure
from epp.extproc.stream import ExtProcStream


def test_each_benchmarked_request_is_routed_to_an_endpoint() -> None:
    director = make_director("predicted-latency")

    async def route(i: int) -> str:
        body = json.dumps({"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 16}).encode()
        stream = ExtProcStream(director, 1 << 20)
        replies = [await stream.on_message(message) for message in _messages(body, f"r{i}")]
        stream.close()
        return str(replies)

    routed = [asyncio.run(route(i)) for i in range(3)]
    assert all("x-gateway-destination-endpoint" in r and "10.0.0.1:800" in r for r in routed)
    assert measure("gie-default", fresh=True, requests=5, trials=1) > 0
