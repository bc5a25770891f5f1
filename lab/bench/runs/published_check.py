"""An engine profile's predictions next to a published measurement of the same deployment.

The measurement is a JSON file (``lab/sim/engine/profiles/measurements/``) naming its source and
listing points: each a batch of requests sent at once (their prompt and output lengths) and the
published mean time to first token and median time per output token; and ``engine``, the served
engine's limits where they differ from the profile's (the step-time model stays the profile's).
``predict`` replays each batch through the simulated engine in virtual time (every request
arriving at 0, delayed by the profile's front end) and reduces it as vLLM's
``benchmark_serving.py`` does: TTFT averaged over all requests (0 for one that returned no
tokens, as the published means count it), TPOT = (latency − TTFT) / (output tokens − 1) over
requests of two or more tokens, median.

``python -m bench.runs.published_check [PROFILE] [MEASUREMENT]`` prints the comparison (defaults:
``llama-3.1-8b-h100`` against Lambda's vLLM benchmark of Llama-3-8B on one H100);
``llm-epp-bench published`` writes it as ``published_check.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.engine import EngineRequest, Profile, load_profile
from sim.engine.offline import distinct_prompt, serve_offline
from sim.engine.profile import PROFILES_DIR
from sim.measure.report import write_results

MEASUREMENTS_DIR = PROFILES_DIR / "measurements"
DEFAULT_MEASUREMENT = MEASUREMENTS_DIR / "lambda-llama3-8b-h100-vllm.json"
DEFAULT_PROFILE = "llama-3.1-8b-h100"
TABLE_HEADER = (
    "| point | TTFT mean ms: published | predicted | error | TPOT median ms: published | predicted | error |"
)


@dataclass(frozen=True, slots=True)
class Point:
    name: str
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    mean_ttft_ms: float
    median_tpot_ms: float


@dataclass(frozen=True, slots=True)
class Comparison:
    point: Point
    mean_ttft_ms: float
    median_tpot_ms: float

    @property
    def ttft_error_pct(self) -> float:
        """(predicted − published) / published, in percent."""
        return 100 * (self.mean_ttft_ms / self.point.mean_ttft_ms - 1)

    @property
    def tpot_error_pct(self) -> float:
        return 100 * (self.median_tpot_ms / self.point.median_tpot_ms - 1)


@dataclass(frozen=True, slots=True)
class Measurement:
    source: str
    engine: dict[str, int]
    points: list[Point]


def load_measurement(path: Path = DEFAULT_MEASUREMENT) -> Measurement:
    """The measurement's source, the served engine's limits and its points."""
    document = json.loads(path.read_text())
    points = [
        Point(
            p["name"],
            tuple(p["input_lens"]),
            tuple(p["output_lens"]),
            float(p["mean_ttft_ms"]),
            float(p["median_tpot_ms"]),
        )
        for p in document["points"]
    ]
    return Measurement(document["source"], document.get("engine", {}), points)


def served_as(profile: Profile, measurement: Measurement) -> Profile:
    """``profile`` with the measured deployment's engine limits."""
    return dataclasses.replace(profile, engine=dataclasses.replace(profile.engine, **measurement.engine))


def predict(profile: Profile, point: Point) -> Comparison:
    """The profile's mean TTFT and median TPOT for the point's batch, sent all at once."""
    requests = {
        index: EngineRequest(f"r{index}", distinct_prompt(index, max(1, tokens)), max(1, out))
        for index, (tokens, out) in enumerate(zip(point.input_lens, point.output_lens, strict=True))
    }
    # The published prompts share no prefix to speak of: distinct token ids per request.
    serve_offline(
        profile,
        [
            (profile.frontend.delay(tokens, 0), requests[index])
            for index, (tokens, out) in enumerate(zip(point.input_lens, point.output_lens, strict=True))
            if out > 0
        ],
    )
    ttfts, tpots = [], []
    for index, out in enumerate(point.output_lens):
        if out == 0:
            ttfts.append(0.0)
            continue
        request = requests[index]
        ttft = request.first_token_time
        ttfts.append(ttft)
        if out > 1:
            tpots.append((request.finish_time - ttft) / (out - 1))
    return Comparison(point, 1000 * float(np.mean(ttfts)), 1000 * float(np.median(tpots)))


def markdown(profile: Profile, measurement: Measurement, comparisons: list[Comparison]) -> str:
    rows = []
    for c in comparisons:
        ttft = f"{c.point.mean_ttft_ms:.1f} | {c.mean_ttft_ms:.1f} | {c.ttft_error_pct:+.1f}%"
        tpot = f"{c.point.median_tpot_ms:.2f} | {c.median_tpot_ms:.2f} | {c.tpot_error_pct:+.1f}%"
        rows.append(f"| {c.point.name} | {ttft} | {tpot} |")
    return "\n".join(
        [
            f"# `{profile.name}` against a published measurement",
            "",
            f"Engine limits as served: {measurement.engine}. Source: {measurement.source}",
            "",
            TABLE_HEADER,
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def run(out_dir: Path, profile_name: str = DEFAULT_PROFILE, path: Path = DEFAULT_MEASUREMENT) -> dict:
    """The comparison, written to ``out_dir`` as published_check.json and .md."""
    measurement = load_measurement(path)
    profile = served_as(load_profile(profile_name), measurement)
    comparisons = [predict(profile, point) for point in measurement.points]
    data = {
        "profile": profile.name,
        "source": measurement.source,
        "engine": measurement.engine,
        "points": [
            {
                "name": c.point.name,
                "mean_ttft_ms": {"published": c.point.mean_ttft_ms, "predicted": round(c.mean_ttft_ms, 2)},
                "median_tpot_ms": {
                    "published": c.point.median_tpot_ms,
                    "predicted": round(c.median_tpot_ms, 3),
                },
                "error_pct": {"ttft": round(c.ttft_error_pct, 1), "tpot": round(c.tpot_error_pct, 1)},
            }
            for c in comparisons
        ],
    }
    write_results(out_dir, "published_check", data, markdown(profile, measurement, comparisons))
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runs.published_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("profile", nargs="?", default=DEFAULT_PROFILE)
    parser.add_argument("measurement", nargs="?", type=Path, default=DEFAULT_MEASUREMENT)
    args = parser.parse_args(argv)
    measurement = load_measurement(args.measurement)
    profile = served_as(load_profile(args.profile), measurement)
    print(markdown(profile, measurement, [predict(profile, point) for point in measurement.points]))


if __name__ == "__main__":
    main()
