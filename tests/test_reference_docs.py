"""docs/reference/ is generated from the code (``make docs``, docs_gen/): the checked-in pages
must be what the code gives today, and the code's docstrings must document what it accepts."""

from __future__ import annotations

import inspect
import re
import tempfile
from pathlib import Path

import pytest

from docs_gen import __main__ as docs_gen
from docs_gen import headers, plugins, sidecars
from epp.scheduling import registry
from epp.settings import EppSettings
from predictor.settings import PredictorSettings
from trainer.settings import TrainerSettings


def test_reference_pages_are_current() -> None:
    stale = docs_gen.stale(docs_gen.render_all())
    assert not stale, f"docs/reference/{', '.join(stale)} out of date: run make docs"


def test_every_plugin_parameter_has_a_meaning() -> None:
    missing = {
        name: [p for p in plugins.parameters(cls) if p not in plugins.documented_parameters(cls)]
        for name, cls in registry.plugin_types().items()
    }
    assert not {name: params for name, params in missing.items() if params}


def test_every_documented_parameter_exists() -> None:
    # A module's tables may document the parameters of each of its types.
    by_module: dict[object, set[str]] = {}
    for cls in registry.plugin_types().values():
        by_module.setdefault(inspect.getmodule(cls), set()).update(plugins.parameters(cls))
    unknown = {
        module.__name__: sorted(set(plugins.parameter_rows(module.__doc__ or "")) - accepted)
        for module, accepted in by_module.items()
    }
    assert not {name: params for name, params in unknown.items() if params}


def test_every_header_the_code_names_is_documented() -> None:
    assert headers.undocumented() == []


def test_every_sidecar_route_is_documented() -> None:
    def normal(path: str) -> str:
        return re.sub(r"\{[^}]*\}", "{}", path)

    with tempfile.TemporaryDirectory() as workdir:
        built = sidecars.apps(Path(workdir))
    for command, (module, app) in built.items():
        doc = normal(module.__doc__ or "")
        undocumented = [f"{m} {p}" for m, p in sidecars.routes(app) if normal(p) not in doc]
        assert not undocumented, f"{command}: {undocumented}"


@pytest.mark.parametrize("model", [EppSettings, TrainerSettings, PredictorSettings])
def test_every_flag_has_a_description(model: type) -> None:
    assert [name for name, field in model.model_fields.items() if not field.description] == []
