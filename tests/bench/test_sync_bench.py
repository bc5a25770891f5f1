"""The sync benchmark's throughput ceiling: cores shared by every process past their idle use,
and one core at most for each EPP process."""

from __future__ import annotations

from bench.runs.sync_bench import ceilings


def test_one_epp_is_bound_by_its_own_core_and_two_by_the_shared_cores() -> None:
    one = {
        "cpu_ms_per_request": {"epp": 1.0, "envoy": 0.5, "replica-0": 0.5},
        "idle_cores": {"epp": 0.0, "envoy": 0.0, "replica-0": 0.0},
    }
    # 2 cores / 2 ms = 1000/s, but the EPP's core allows 1000/s too; a third core adds nothing.
    assert ceilings(one, 2) == {"2_cores_rps": 1000.0, "3_cores_rps": 1000.0}
    two = {
        "cpu_ms_per_request": {"epp-0": 0.75, "epp-1": 0.75, "envoy": 0.5, "nats": 0.0},
        "idle_cores": {"epp-0": 0.25, "epp-1": 0.25, "envoy": 0.0, "nats": 0.0},
    }
    # Shared: (2 - 0.5) / 2 ms = 750/s, (3 - 0.5) / 2 ms = 1250/s; each EPP: 0.75 core / 0.75 ms = 1000/s.
    assert ceilings(two, 2) == {"2_cores_rps": 750.0, "3_cores_rps": 1000.0}
