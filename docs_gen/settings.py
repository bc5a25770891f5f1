"""Command-line flags as tables, from the pydantic settings models the commands parse them into
(one flag per field: ``--retrain-interval-s`` for ``retrain_interval_s``)."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from docs_gen.plugins import accepts
from docs_gen.rst import cell


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if value is None or value == []:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`"


def flag_table(model: type[BaseModel]) -> list[str]:
    out = ["| flag | default | accepts | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        out.append(f"| `{flag}` | {_default(field)} | {accepts(field)} | {cell(field.description or '')} |")
    return out
