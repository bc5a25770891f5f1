from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.config import new_client_from_config_dict

from tests.k8s.fake_apiserver import FakeApiServer


@pytest.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def kube_api(apiserver: FakeApiServer) -> AsyncIterator[ApiClient]:
    client = await new_client_from_config_dict(apiserver.kubeconfig())
    yield client
    await client.close()


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
