"""An engine's HTTP surface as the scraper sees it: ``/metrics`` and ``/v1/models``, on aiohttp."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from sim.openai_api import models_response

METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.1\n"


@dataclass
class Engine:
    """Serves /metrics (``metrics_delay_s`` late), and /v1/models with ``max_model_len`` (404
    while it is None)."""

    max_model_len: int | None = None
    models_calls: list[float] = field(default_factory=list)
    metrics_calls: int = 0
    port: int = 0
    metrics_body: bytes = METRICS
    metrics_delay_s: float = 0.0

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_calls += 1
        await asyncio.sleep(self.metrics_delay_s)
        return web.Response(body=self.metrics_body, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        self.models_calls.append(time.monotonic())
        if self.max_model_len is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(models_response("tiny", "/m", self.max_model_len, created=1))


async def serve(engine: Engine) -> web.AppRunner:
    """Serve ``engine`` on a free loopback port (set in ``engine.port``); clean up the runner."""
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/v1/models", engine.models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner
