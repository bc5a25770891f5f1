"""``llm-epp-bench``: benchmarks, each writing JSON + Markdown + PNG into ``--out``.

=========  ==================================================================================
name       what it measures
=========  ==================================================================================
overhead   the EPP's added latency, throughput and CPU through real Envoy (stub engines)
predictor  predictor throughput/latency, trainer retrain time, prediction error (MAPE)
fidelity   the simulator (tiny-cpu profile) against real vLLM at three load levels
kv-index   precise prefix index: lookup time (100k tokens, 64 endpoints), memory, event ingest
all        every benchmark above
=========  ==================================================================================
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import fidelity, kv_index_bench, overhead, predictor_bench

BENCHMARKS: dict[str, Callable[[Path], Any]] = {
    "overhead": overhead.run,
    "predictor": predictor_bench.run,
    "fidelity": fidelity.run,
    "kv-index": kv_index_bench.run,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llm-epp-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in [*BENCHMARKS, "all"]:
        p = sub.add_parser(name, help="every benchmark" if name == "all" else f"the {name} benchmark")
        p.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    selected = BENCHMARKS if args.command == "all" else {args.command: BENCHMARKS[args.command]}
    for name, run in selected.items():
        print(f"== {name}")
        run(args.out)
    print(f"results written to {args.out}/")


if __name__ == "__main__":
    main()
