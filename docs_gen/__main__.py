"""``python -m docs_gen``: write docs/reference/; ``--check`` only says which files are stale."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from docs_gen import chart, headers, metrics, plugins, sidecars

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"


def pages(workdir: Path) -> dict[str, Callable[[], str]]:
    return {
        "plugins.md": plugins.render,
        "headers.md": headers.render,
        "sidecars.md": lambda: sidecars.render_sidecars(workdir),
        "flags.md": sidecars.render_flags,
        "chart-values.md": chart.render,
        "metrics.md": metrics.render,
    }


def render_all() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as workdir:
        return {name: render() for name, render in pages(Path(workdir)).items()}


def stale(rendered: dict[str, str]) -> list[str]:
    return [
        name
        for name, text in rendered.items()
        if not (REFERENCE / name).exists() or (REFERENCE / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    rendered = render_all()
    out_of_date = stale(rendered)
    if args.check:
        for name in out_of_date:
            print(f"docs/reference/{name} is stale: run make docs", file=sys.stderr)
        return 1 if out_of_date else 0
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for name in out_of_date:
        (REFERENCE / name).write_text(rendered[name])
        print(f"wrote docs/reference/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
