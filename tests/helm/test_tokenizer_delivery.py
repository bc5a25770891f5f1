"""The chart gives the EPP the served model's tokenizer, from each source, and the EPP can load
what arrives: the init containers' commands (copy from an image, download from the Hub) run
here on the rendered command lines, with their container paths mapped to temporary ones.

The Hugging Face Hub cannot be reached here: the download runs the real ``hf`` CLI against
tests/helm/fake_hub.py. Nothing has run in a cluster (kubelet volume projection included).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.app import TOKENIZER_FILES, load_tokenizer
from epp.main import parse_args as epp_args
from epp.tokenizer.model import ModelTokenizer
from sim.models import TINY_MODEL_DIR
from sim.processes import BIN
from tests.helm import fake_hub
from tests.helm.render import CHART, HelmFailed, Rendered, ci_values, merged, render

CI_VALUES = ci_values()
TINY_VOCAB = ModelTokenizer(TINY_MODEL_DIR).vocab_size


DEFAULT_SOURCE = yaml.safe_load((CHART / "values.yaml").read_text())["inferenceExtension"]["tokenizer"][
    "source"
]
# The seed guide's command, exactly: helm upgrade --install NAME
GUIDE_SETS = (
    "inferencePool.modelServers.matchLabels.app=MODEL_SERVER_LABEL",
    "provider.name=gke",
    "inferenceExtension.monitoring.gke.enabled=true",
    "inferenceExtension.latencyPredictor.enabled=true",
)


def _source(values: dict[str, Any]) -> str:
    return values.get("inferenceExtension", {}).get("tokenizer", {}).get("source", DEFAULT_SOURCE)


def _set_values(sets: tuple[str, ...]) -> dict[str, Any]:
    """The values ``--set`` gives (dotted keys; true/false as booleans, as Helm parses them)."""
    values: dict[str, Any] = {}
    for assignment in sets:
        key, value = assignment.split("=", 1)
        *parents, leaf = key.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = {"true": True, "false": False}.get(value, value)
    return values


def _ci_with(source: str) -> dict[str, Any]:
    """The first ci value set whose tokenizer comes from ``source``."""
    return next(values for values in CI_VALUES.values() if _source(values) == source)


def _tokenizer_values(values: dict[str, Any]) -> dict[str, Any]:
    return values["inferenceExtension"]["tokenizer"]


def _pod(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("Deployment")["spec"]["template"]["spec"]


def _wiring(rendered: Rendered) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The volume behind the EPP's --tokenizer-dir, the EPP's mount of it, the init containers."""
    pod = _pod(rendered)
    [epp] = [c for c in pod["containers"] if c["name"] == "epp"]
    settings, _ = epp_args(epp["args"])
    [mount] = [m for m in epp["volumeMounts"] if m["mountPath"] == str(settings.tokenizer_dir)]
    assert mount.get("readOnly") is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume, mount, pod.get("initContainers", [])


def _mount_path(container: dict[str, Any], volume: str) -> str:
    [path] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return path


def _run_here(
    container: dict[str, Any], paths: dict[str, Path], secrets: dict[str, dict[str, str]] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``container``'s command on this machine: container paths in its arguments and env
    replaced by local ones (``paths``), secretKeyRef env from ``secrets`` (name → key → value),
    programs from the project's environment (which the image installs) or the system."""

    # One pass, so a replacement is never rewritten again; a path counts at the start of an
    # argument or after "=", up to a "/" or the end.
    insides = "|".join(re.escape(inside) for inside in sorted(paths, key=len, reverse=True))
    pattern = re.compile(rf"(?<![^=])({insides})(?=/|$)")

    def local(text: str) -> str:
        return pattern.sub(lambda match: str(paths[match[1]]), text)

    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(paths["/tmp"])}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = local(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = (secrets or {})[ref["name"]][ref["key"]]
    command = [local(arg) for arg in container["command"]]
    command[0] = shutil.which(command[0], path=env["PATH"]) or command[0]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def test_the_ci_values_cover_every_tokenizer_source() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    tokenizer = schema["properties"]["inferenceExtension"]["properties"]["tokenizer"]
    sources = set(tokenizer["properties"]["source"]["enum"]) - {""}
    assert {_source(values) for values in CI_VALUES.values()} == sources


def test_the_files_the_chart_delivers_are_all_the_epp_needs(tmp_path: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL_DIR / name, tmp_path)
    assert load_tokenizer(tmp_path).vocab_size == TINY_VOCAB


@pytest.mark.parametrize("source", ["configMap", "secret"])
def test_tokenizer_from_an_existing_config_map_or_secret(source: str) -> None:
    values = _ci_with(source)
    volume, _, init_containers = _wiring(render(values))
    assert init_containers == []
    name = _tokenizer_values(values)[source]["name"]
    projected = volume["configMap"] if source == "configMap" else volume["secret"]
    assert projected.get("name", projected.get("secretName")) == name
    # Only these keys, each at its own file name; a missing key fails the pod's start visibly.
    assert projected["items"] == [{"key": f, "path": f} for f in TOKENIZER_FILES]


def test_tokenizer_from_a_volume_at_its_sub_path() -> None:
    values = _ci_with("volume")
    volume, mount, init_containers = _wiring(render(values))
    assert init_containers == []
    wanted = _tokenizer_values(values)["volume"]
    assert {k: v for k, v in volume.items() if k != "name"} == wanted["spec"]
    assert mount["subPath"] == wanted["subPath"]


def test_tokenizer_copied_from_an_image_by_an_init_container(tmp_path: Path) -> None:
    values = _ci_with("image")
    image = _tokenizer_values(values)["image"]
    volume, _, [init] = _wiring(render(values))
    assert "emptyDir" in volume
    assert init["image"] == f"{image['repository']}:{image['tag']}"
    filled = tmp_path / "tokenizer-volume"
    filled.mkdir()
    paths = {image["path"]: TINY_MODEL_DIR, _mount_path(init, volume["name"]): filled, "/tmp": tmp_path}
    result = _run_here(init, paths)
    assert result.returncode == 0, result.stderr
    assert load_tokenizer(filled).vocab_size == TINY_VOCAB


def test_tokenizer_downloaded_from_the_hub_with_the_secrets_token(tmp_path: Path) -> None:
    values = _ci_with("hub")
    token_secret = merged({"key": "HF_TOKEN"}, _tokenizer_values(values)["hub"]["tokenSecret"])
    secrets = {token_secret["name"]: {token_secret["key"]: "hf_test_token"}}
    with fake_hub.serve(TINY_MODEL_DIR) as hub:
        endpoint = {"inferenceExtension": {"tokenizer": {"hub": {"endpoint": hub.url}}}}
        rendered = render(merged(values, endpoint))
        volume, _, [init] = _wiring(rendered)
        [epp] = [c for c in _pod(rendered)["containers"] if c["name"] == "epp"]
        assert init["image"] == epp["image"]  # the EPP's image, which has `hf`
        filled = tmp_path / "tokenizer-volume"
        filled.mkdir()
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        result = _run_here(init, {_mount_path(init, volume["name"]): filled, "/tmp": tmp}, secrets)
    assert result.returncode == 0, result.stdout + result.stderr
    assert load_tokenizer(filled).vocab_size == TINY_VOCAB
    repo = _tokenizer_values(values)["hub"]["repo"]
    downloads = [(path, auth) for path, auth in hub.requests if path.startswith(f"/{repo}/resolve/")]
    assert {path.rsplit("/", 1)[1] for path, _ in downloads} == set(TOKENIZER_FILES)
    assert {auth for _, auth in downloads} == {"Bearer hf_test_token"}


def _epp(rendered: Rendered) -> dict[str, Any]:
    [epp] = [c for c in _pod(rendered)["containers"] if c["name"] == "epp"]
    return epp


def _epp_without_tokenizer_volume(rendered: Rendered, source: str) -> dict[str, Any]:
    """The EPP container of a chart that lints cleanly and gives it ``--tokenizer-source``
    ``source``, with no tokenizer volume, mount or init container."""
    assert not rendered.lint["Errors"]
    epp = _epp(rendered)
    settings, _ = epp_args(epp["args"])
    assert settings.tokenizer_source == source and settings.tokenizer_dir is None
    pod = _pod(rendered)
    assert "initContainers" not in pod
    assert "tokenizer" not in {v["name"] for v in pod["volumes"]}
    assert "tokenizer" not in {m["name"] for m in epp["volumeMounts"]}
    return epp


def test_the_guides_command_alone_installs_with_the_auto_source() -> None:
    values = _set_values(GUIDE_SETS)
    assert CI_VALUES["guide-command"] == values  # chart-testing lints the same values
    rendered = render(values)  # installed into the test API server; raises if Helm refuses
    assert all(m["Severity"] <= 1 for m in rendered.lint["Messages"]), rendered.lint  # info only
    epp = _epp_without_tokenizer_volume(rendered, "auto")
    env = {e["name"]: e for e in epp["env"]}
    # The EPP downloads into HF_HOME, which must be on a writable mount (the root is read-only).
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    [tmp] = [m for m in epp["volumeMounts"] if env["HF_HOME"]["value"].startswith(m["mountPath"] + "/")]
    assert not tmp.get("readOnly")
    assert "HF_TOKEN" not in env and "HF_ENDPOINT" not in env
    assert "llm_epp_tokenizer_estimated" in rendered.notes
    assert "inferenceExtension.tokenizer.hub.tokenSecret.name" in rendered.notes


def test_the_auto_source_takes_the_hub_token_and_mirror() -> None:
    hub = {"tokenSecret": {"name": "hf-token"}, "endpoint": "https://hf-mirror.example"}
    values = merged(_set_values(GUIDE_SETS), {"inferenceExtension": {"tokenizer": {"hub": hub}}})
    rendered = render(values)
    env = {e["name"]: e for e in _epp(rendered)["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example"
    assert "Secret hf-token" in rendered.notes


@pytest.mark.parametrize("source", ["configMap", "secret", "volume", "image", "hub"])
def test_an_explicit_source_gives_the_epp_its_directory(source: str) -> None:
    rendered = render(_ci_with(source))
    settings, _ = epp_args(_epp(rendered)["args"])
    assert settings.tokenizer_source == "dir" and settings.tokenizer_dir is not None
    assert f"from source {source}" in rendered.notes


def test_the_estimate_source_runs_the_epp_without_a_tokenizer() -> None:
    rendered = render(_ci_with("estimate"))
    epp = _epp_without_tokenizer_volume(rendered, "estimate")
    assert "HF_HOME" not in {e["name"] for e in epp.get("env", [])}
    assert "token counts are estimated from the text" in rendered.notes


@pytest.mark.parametrize("source", ["auto", "hub"])
def test_the_tokenizer_can_run_on_one_prompt_in_n(source: str) -> None:
    values = merged(_ci_with(source), {"inferenceExtension": {"tokenizer": {"tokenizeEvery": 16}}})
    settings, _ = epp_args(_epp(render(values))["args"])
    assert settings.tokenize_every == 16


def test_sampling_a_tokenizer_needs_one() -> None:
    values = merged(_ci_with("estimate"), {"inferenceExtension": {"tokenizer": {"tokenizeEvery": 16}}})
    with pytest.raises(HelmFailed, match="source estimate has none"):
        render(values)
