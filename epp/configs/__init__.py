"""Shipped EndpointPickerConfig files, loadable by name (``--config gie-default``)."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).parent


def config_path(name_or_path: str) -> Path:
    """A shipped config by name (file stem), or a path to a YAML file."""
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"no config named {name_or_path!r} (shipped: {shipped}) and no such file")
