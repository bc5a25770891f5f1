from __future__ import annotations

from collections.abc import AsyncIterator

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
