"""The gateway bootstrap with active-active EPP replicas must be accepted by the real Envoy binary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from epp.envoy_config import EXT_PROC_HEALTH_SERVICE, gateway_bootstrap, with_epp_replicas
from sim.processes import envoy_binary


def test_envoy_validates_a_health_checked_ext_proc_cluster_of_two_epps(tmp_path: Path) -> None:
    single = gateway_bootstrap(listen_port=18081, epp_address=("127.0.0.1", 19002))
    bootstrap = with_epp_replicas(single, [("127.0.0.1", 19002, 19003), ("127.0.0.1", 19012, 19013)])
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [epp] = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp"]
    hosts = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["health_check_config"]["port_value"] for h in hosts] == [19003, 19013]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_HEALTH_SERVICE
    assert "outlier_detection" in epp and "typed_extension_protocol_options" in epp  # still HTTP/2
    [single_epp] = [c for c in single["static_resources"]["clusters"] if c["name"] == "epp"]
    assert "health_checks" not in single_epp  # the input is left as it was
