"""Render the chart with the real Helm engine, for the chart tests.

helm-sdkpy (Helm's Go library behind a Python binding) needs Python 3.12, so it lives in
its own environment, .venv-helm (``make helm-env``), and runs as a subprocess
(tests/helm/helm_render.py). It has no client-only ``helm template``: Helm installs the
release into the API server of its kubeconfig, here the in-process fake of tests/k8s (no real
cluster can run here), with ``HELM_DRIVER=memory`` so the release record stays in Helm's
memory. What comes back is Helm's own rendered manifest (and ``helm lint``'s result); the
fake also ends up holding every object as Helm posted it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.fake_apiserver import FakeApiServer

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "llm-epp"
HELM_PYTHON = ROOT / ".venv-helm" / "bin" / "python"
RELEASE = "vllm-llama3-8b-instruct"
NAMESPACE = "inference"
KUBERNETES_VERSION = "1.33"
"""The Kubernetes version whose schemas rendered objects are validated against."""


@dataclass(frozen=True)
class Rendered:
    docs: list[dict[str, Any]]
    lint: dict[str, Any]
    posted: list[dict[str, Any]]
    notes: str = ""
    """What ``helm install`` prints after installing (templates/NOTES.txt)."""

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        [doc] = self.of_kind(kind)
        return doc

    def named(self, kind: str, name: str) -> dict[str, Any]:
        [doc] = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc


class HelmFailed(Exception):
    pass


async def _install(values: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    server = FakeApiServer()
    await server.start()
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig") as kubeconfig:
            yaml.safe_dump(server.kubeconfig(NAMESPACE), kubeconfig)
            kubeconfig.flush()
            process = await asyncio.create_subprocess_exec(
                str(HELM_PYTHON),
                str(Path(__file__).with_name("helm_render.py")),
                kubeconfig.name,
                NAMESPACE,
                RELEASE,
                str(CHART),
                json.dumps(values),
                env={"HELM_DRIVER": "memory", "HOME": tempfile.gettempdir(), "PATH": "/usr/bin:/bin"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(process.communicate(), 120)
        if process.returncode != 0:
            raise RuntimeError(f"helm renderer exited {process.returncode}: {err.decode()[-2000:]}")
        return json.loads(out), list(server.objects.values())
    finally:
        await server.stop()


@functools.cache
def _render(values_json: str) -> Rendered:
    result, posted = asyncio.run(_install(json.loads(values_json)))
    if "error" in result:
        raise HelmFailed(result["error"])
    docs = [d for d in yaml.safe_load_all(result["manifest"]) if d]
    notes = result.get("release", {}).get("info", {}).get("notes", "")
    return Rendered(docs=docs, lint=result["lint"], posted=posted, notes=notes)


def ci_values() -> dict[str, dict[str, Any]]:
    """The chart's value sets for lint and template tests, chart-testing's ``ci/NAME-values.yaml``,
    by NAME."""
    return {
        path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text())
        for path in sorted((CHART / "ci").glob("*-values.yaml"))
    }


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in, as Helm merges a values file over another."""
    out = dict(base)
    for key, value in override.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if nested else value
    return out


def render(values: dict[str, Any]) -> Rendered:
    """Helm's manifest for ``values`` (cached per values); raise :class:`HelmFailed` if Helm refuses."""
    return _render(json.dumps(values, sort_keys=True))
