"""epp/ is a one-way stack, the product imports nothing of the lab, the simulator nothing of the
benchmarks, and bench/ is a stack: import-linter checks the contracts in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_import_contract_is_kept() -> None:
    result = lint_imports(ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


def test_an_import_against_the_layers_is_reported(tmp_path: Path) -> None:
    """The same contract with the director put below the scheduling core that it imports."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = [layer for layer in config["contracts"][0]["layers"] if "requestcontrol" not in layer]
    layers.append("epp.requestcontrol")
    contract = "\n".join(f'    "{layer}",' for layer in layers)
    upside_down = tmp_path / "contract.toml"
    upside_down.write_text(
        '[tool.importlinter]\nroot_package = "epp"\n\n[[tool.importlinter.contracts]]\n'
        f'name = "upside down"\ntype = "layers"\nlayers = [\n{contract}\n]\n'
    )
    result = lint_imports(upside_down)
    assert result.returncode == 1
    assert "Contracts: 0 kept, 1 broken." in result.stdout
    assert "epp.requestcontrol.director -> epp.scheduling" in result.stdout


def test_an_import_of_a_forbidden_package_is_reported(tmp_path: Path) -> None:
    """The product contract, with a package that the EPP does import among the forbidden ones."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["name"] == "the product imports nothing of the lab"]
    forbidden = ", ".join(f'"{m}"' for m in [*contract["forbidden_modules"], "tokenizers"])
    sources = ", ".join(f'"{m}"' for m in contract["source_modules"])
    roots = ", ".join(f'"{m}"' for m in config["root_packages"])
    with_tokenizers = tmp_path / "contract.toml"
    with_tokenizers.write_text(
        f"[tool.importlinter]\nroot_packages = [{roots}]\ninclude_external_packages = true\n\n"
        f'[[tool.importlinter.contracts]]\nname = "no tokenizers"\ntype = "forbidden"\n'
        f"source_modules = [{sources}]\nforbidden_modules = [{forbidden}]\n"
    )
    result = lint_imports(with_tokenizers)
    assert result.returncode == 1
    assert "Contracts: 0 kept, 1 broken." in result.stdout
    assert "epp.tokenizer.model -> tokenizers" in result.stdout
