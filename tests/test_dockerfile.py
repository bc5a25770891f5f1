"""The Dockerfile builds from the same package list as pyproject.toml. No Docker engine runs
here, so the image itself is not built in tests (``make image`` builds it where one does)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_copies_every_packaged_tree_and_runs_as_non_root() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.MULTILINE))
    assert copied == packages
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not packages & set(ignored)
