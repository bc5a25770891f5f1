"""The Kubernetes API client: in-cluster service account, or a kubeconfig file."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_incluster_config, new_client_from_config

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


async def api_client(kubeconfig: Path | None) -> ApiClient:
    """A client from ``kubeconfig`` if given, else from the pod's service account."""
    if kubeconfig is not None:
        return await new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    configuration = Configuration()
    load_incluster_config(client_configuration=configuration)
    return ApiClient(configuration=configuration)


def default_namespace() -> str:
    """The pod's own namespace when in a cluster, else ``default``."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def default_identity() -> str:
    """This replica's name in the leader lease: the pod name (``HOSTNAME``) plus the process id."""
    return f"{os.environ.get('HOSTNAME', 'epp')}_{os.getpid()}"
