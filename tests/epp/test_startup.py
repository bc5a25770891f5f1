"""The EPP process refuses to start without the served model's tokenizer, and says how to give it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from epp.app import TOKENIZER_FILES, EppApp
from epp.load.endpoint_speed import DecodeConditions
from epp.main import parse_args
from epp.plugins.endpoint_speed import find_endpoint_speeds
from epp.scheduling.types import Endpoint
from sim.models import TINY_MODEL_DIR
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


def test_measured_endpoint_speeds_are_exported_per_endpoint(tmp_path: Path) -> None:
    endpoints = write_endpoints_file(tmp_path / "endpoints.yaml", [("127.0.0.1", 1), ("127.0.0.1", 2)])
    config = tmp_path / "speed.yaml"
    config.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        "- type: endpoint-speed-producer\n- type: token-load-scorer\n"
    )
    base = ["--endpoints-file", str(endpoints), "--tokenizer-dir", str(TINY_MODEL_DIR)]
    app = EppApp(parse_args([*base, "--config", str(config)])[0])
    fast, slow = "replica-0", "replica-1"
    app.store.replace(
        [Endpoint(fast, "127.0.0.1", 1), Endpoint(slow, "127.0.0.1", 2)]
    )  # as the file source will

    def slowness(endpoint: str) -> float | None:
        labels = {"name": app.settings.pool_name, "model_server_pod": endpoint}
        return app.registry.get_sample_value("llm_epp_endpoint_slowness", labels)

    assert (slowness(fast), slowness(slow)) == (1.0, 1.0)  # not measured yet
    speeds = find_endpoint_speeds(app.pipeline.plugins.values())
    assert speeds is not None
    for _ in range(10):
        speeds.observe(fast, DecodeConditions(4, 0.0), 0.01)
        speeds.observe(slow, DecodeConditions(4, 0.0), 0.04)
    assert (slowness(fast), slowness(slow)) == (speeds.slowness(fast), speeds.slowness(slow))
    assert slowness(slow) / slowness(fast) == pytest.approx(4.0, rel=0.1)
    without = EppApp(parse_args(base)[0])  # gie-default measures no speeds
    assert without.registry.get_sample_value("llm_epp_endpoint_slowness", {"name": "x"}) is None
