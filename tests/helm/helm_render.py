"""Render a chart with the real Helm engine (Helm's Go library, from the helm-sdkpy package).

Runs in .venv-helm (Python 3.12: helm-sdkpy needs it) as a subprocess of the tests. helm-sdkpy
has no client-only template action, so this installs the release into the API server named
by the kubeconfig (the tests' in-process fake) and prints the rendered manifest Helm reports.
helm-sdkpy's lint takes no values either, so it lints a copy of the chart whose values.yaml
has the given values merged in (what ``helm lint -f VALUES`` does).
Usage: helm_render.py KUBECONFIG NAMESPACE RELEASE CHART VALUES_JSON → JSON on stdout:
{"manifest": "...", "lint": {...}} or {"error": "..."}.
"""

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import helm_sdkpy
import yaml


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if nested else value
    return out


async def lint_with(config: helm_sdkpy.Configuration, chart: str, values: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / Path(chart).name
        shutil.copytree(chart, copy, symlinks=False)
        defaults = yaml.safe_load((copy / "values.yaml").read_text()) or {}
        (copy / "values.yaml").write_text(yaml.safe_dump(merged(defaults, values)))
        return await helm_sdkpy.Lint(config).run(str(copy))


async def main() -> None:
    kubeconfig, namespace, release, chart, values_json = sys.argv[1:6]
    config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=kubeconfig)
    try:
        values = json.loads(values_json)
        result = await helm_sdkpy.Install(config).run(release, chart, values=values, wait=False, timeout=60)
        lint = await lint_with(config, chart, values)
    except helm_sdkpy.HelmError as exc:
        print(json.dumps({"error": str(exc)}))
        return
    print(json.dumps({"manifest": result.get("manifest", ""), "lint": lint, "release": result}))


asyncio.run(main())
