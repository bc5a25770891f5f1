"""``llm-epp-bench tokenize`` on short conversations: its output, and that each arm did what it says."""

from __future__ import annotations

import json
from pathlib import Path

from bench.runs.tokenize_bench import TokenizeBenchSettings, run


def test_tokenize_bench_writes_its_cases(tmp_path: Path) -> None:
    run(tmp_path, TokenizeBenchSettings(prompt_tokens=1500, repeats=2))
    data = json.loads((tmp_path / "tokenize.json").read_text())
    cases = {(c["case"], c["arm"]): c for c in data["cases"]}
    assert data["identical"] is True
    assert cases[("extension", "with cache")]["cache"] == {"hits": 2, "misses": 3, "fallbacks": 0}
    assert cases[("first seen", "with cache")]["cache"]["hits"] == 0
    assert "cache" not in cases[("first seen", "without cache")]
    extension = cases[("extension", "with cache")]
    assert 0 < extension["new_tokens"] < extension["prompt_tokens"] >= 1500
    assert "| extension | with cache |" in (tmp_path / "tokenize.md").read_text()
    assert (tmp_path / "tokenize.png").stat().st_size > 0
