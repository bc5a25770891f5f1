"""The EPP process refuses to start without the served model's tokenizer, and says how to give it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from epp.app import TOKENIZER_FILES, EppApp
from epp.main import parse_args
from epp.tokenization import TINY_MODEL_DIR
from sim.processes import BIN, write_endpoints_file

HOW_TO_GIVE_ONE = ("--tokenizer-dir", *TOKENIZER_FILES, "inferenceExtension.tokenizer")


def _run_epp(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("127.0.0.1", 1)])
    argv = [str(BIN / "llm-epp"), "--endpoints-file", str(endpoints), "--grpc-port", "0", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_without_a_tokenizer_the_epp_exits_saying_how_to_give_one(tmp_path: Path) -> None:
    result = _run_epp(tmp_path)
    assert result.returncode == 2
    assert "--tokenizer-dir is required" in result.stderr
    assert all(part in result.stderr for part in HOW_TO_GIVE_ONE), result.stderr


@pytest.mark.parametrize("missing", TOKENIZER_FILES)
def test_a_tokenizer_dir_without_the_files_stops_the_epp_with_one_line(tmp_path: Path, missing: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in set(TOKENIZER_FILES) - {missing}:
        shutil.copy(TINY_MODEL_DIR / name, model)
    result = _run_epp(tmp_path, "--tokenizer-dir", str(model))
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()  # a message, not a traceback
    assert line.startswith(f"llm-epp: --tokenizer-dir {model} has no {missing};")
    assert all(part in line for part in HOW_TO_GIVE_ONE), line


def test_the_max_model_len_flag_is_the_directors_fallback_context(tmp_path: Path) -> None:
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("127.0.0.1", 1)])
    base = ["--endpoints-file", str(endpoints), "--tokenizer-dir", str(TINY_MODEL_DIR)]
    settings, _ = parse_args([*base, "--max-model-len", "4096"])
    assert EppApp(settings).director.default_max_model_len == 4096
    assert parse_args(base)[0].max_model_len is None
    with pytest.raises(SystemExit):
        parse_args([*base, "--max-model-len", "0"])


def test_the_estimate_source_routes_on_counts_from_the_text_and_says_so(tmp_path: Path) -> None:
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("127.0.0.1", 1)])
    settings, _ = parse_args(["--endpoints-file", str(endpoints), "--tokenizer-source", "estimate"])
    app = EppApp(settings)
    assert app.auto_tokenizer is None and not app.director.tokenizer.exact
    # 4 bytes a token, the ids those bytes: no vocabulary involved.
    assert app.director.tokenizer.encode("abcdefgh") == [0x61626364, 0x65666768]
    assert app.registry.get_sample_value("llm_epp_tokenizer_estimated", {"name": settings.pool_name}) == 1
    result = _run_epp(tmp_path, "--tokenizer-source", "estimate", "--tokenizer-dir", str(TINY_MODEL_DIR))
    assert (
        result.returncode == 2
        and "--tokenizer-dir is for --tokenizer-source dir, not estimate" in result.stderr
    )
