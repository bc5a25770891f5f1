"""A training server app running in process, with an HTTP client on it (no socket)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from trainer.server import create_app
from trainer.service import TrainerService
from trainer.settings import TrainerSettings

Trainer = tuple[httpx.AsyncClient, TrainerService]


async def started(settings: TrainerSettings) -> AsyncIterator[Trainer]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://trainer") as client:
            yield client, app.state.service
