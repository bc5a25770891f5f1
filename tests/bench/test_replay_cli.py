"""``llm-epp-bench replay`` refuses what it cannot run before it starts any process."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "gie-default,nope"], "no config named 'nope'"),
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--profile", "nope"], "unknown profile 'nope'"),
        (["--profile", "default:2,instant:x"], "is not NAME:COUNT"),
        (["--profile", "default:2,instant:2", "--replicas", "3"], "disagrees with the 4 replicas"),
        (["--rate-scale", "0"], "expected a positive number"),
        (["--configs", ","], "--configs names no config"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--virtual", "--configs", "gie-default,epp/configs/random.yaml"], "not epp/configs/random.yaml"),
    ],
)
def test_replay_rejects_bad_arguments(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", *argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
