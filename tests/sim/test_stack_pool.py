"""``llm-epp-stack --sim-profile``: a mixed pool starts each replica on its own profile variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.datalayer.static_file import load_endpoints
from sim import stack
from sim.engine.pool import PROFILE_LABEL
from sim.stack import LocalStack, StackConfig


def test_each_replica_is_started_on_its_pool_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    def spawn(name: str, argv: list[str], workdir: Path) -> Any:
        started.append(argv)
        return name

    monkeypatch.setattr(stack, "spawn", spawn)
    monkeypatch.setattr(stack, "wait_until", lambda component, check: None)
    config = StackConfig(replicas=3, sim_profile="default:2,default+slowdown=2.5:1", workdir=tmp_path)
    local = LocalStack(config)
    for index in range(3):
        local.start_replica(index)
    profiles = [argv[argv.index("--profile") + 1] for argv in started]
    assert profiles == ["default", "default", "default+slowdown=2.5"]


@pytest.mark.parametrize("pool", ["default:2,nope:2", "default:2,default:x"])
def test_a_bad_pool_is_refused_before_anything_starts(pool: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        stack.main(["--sim-profile", pool])
    assert exit_info.value.code == 2
    assert "usage: llm-epp-stack" in capsys.readouterr().err


def test_the_epp_sees_each_replicas_variant_as_a_label(tmp_path: Path) -> None:
    config = StackConfig(replicas=3, sim_profile="default:2,default+slowdown=2.5:1", workdir=tmp_path)
    local = LocalStack(config)
    endpoints = load_endpoints(local.write_endpoints())
    assert [e.labels for e in endpoints] == [
        {PROFILE_LABEL: "default"},
        {PROFILE_LABEL: "default"},
        {PROFILE_LABEL: "default+slowdown=2.5"},
    ]
