"""``llm-epp-bench``: benchmarks, each writing JSON + Markdown + PNG into ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import overhead


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llm-epp-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [("overhead", "EPP overhead through real Envoy"), ("all", "every benchmark")]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    if args.command in ("overhead", "all"):
        overhead.run(args.out)
    print(f"results written to {args.out}/")


if __name__ == "__main__":
    main()
