"""The stack benchmark's session tables, from results of known shape."""

from __future__ import annotations

from bench.runs.stack_overhead import _floor_rows, _session_rows


def _turn(turn: int, tokens: int, cpu: float) -> dict[str, float]:
    return {"turn": turn, "prompt_tokens": tokens, "epp_cpu_ms": cpu, "epp_cpu_net_of_idle_ms": cpu - 1}


def test_session_rows_band_both_phases_and_leave_out_first_turns() -> None:
    one_at_a_time = [_turn(0, 500, 30.0), _turn(1, 1_000, 2.0), _turn(2, 9_000, 3.0), _turn(3, 9_500, 5.0)]
    at_once = [_turn(0, 600, 40.0), _turn(1, 25_000, 4.0)]
    result = {
        "config": "gie-default",
        "sessions": {
            "turns": one_at_a_time,
            "first_seen": {"prompt_tokens": 26_000, "epp_cpu_ms": 20.0, "epp_cpu_net_of_idle_ms": 18.0},
            "extension": {"prompt_tokens": 26_500, "epp_cpu_ms": 3.0, "epp_cpu_net_of_idle_ms": 2.5},
        },
        "concurrent_sessions": at_once,
    }
    assert _session_rows(result, 8) == [
        ["gie-default", "one at a time", "0k–8k", 1, 2.0, 2.0, 1.0],
        ["gie-default", "one at a time", "8k–16k", 2, 5.0, 5.0, 4.0],
        ["gie-default", "one at a time", "first_seen (26000)", 1, 20.0, "", 18.0],
        ["gie-default", "one at a time", "extension (26500)", 1, 3.0, "", 2.5],
        ["gie-default", "8 at once (per round)", "24k–40k", 1, 4.0, 4.0, 3.0],
    ]


def _short(concurrency: int, rps: float, net: float) -> dict:
    return {
        "concurrency": concurrency,
        "with_epp": {"rps": rps},
        "added_p50_ms": 1.5,
        "epp_net_of_idle_ms_per_request": net,
        "cpu_ms_per_request": {"envoy": 0.4},
    }


def _wrk(rps: float, cpu: float) -> dict:
    return {"connections": 16, "wrk": {"rps": rps}, "cpu_ms_per_request": {"epp": cpu, "envoy": 0.3}}


def test_floor_rows_put_the_floor_beside_the_config_it_ran_with_and_only_that_one() -> None:
    floor = {"short": [_short(16, 900.0, 0.7)], "wrk": _wrk(950.0, 0.8)}
    with_floor = {"config": "predicted-latency", "short": [_short(16, 700.0, 0.9)], "wrk": _wrk(800.0, 1.1)}
    without = {"config": "gie-default", "short": [_short(16, 750.0, 0.85)], "wrk": _wrk(820.0, 1.0)}
    assert _floor_rows([{**with_floor, "grpc_floor": floor}, without]) == [
        ["grpc-floor", "concurrency 16", 900.0, 1.5, 0.7, 0.4],
        ["grpc-floor", "wrk, 16 connections", 950.0, "", 0.8, 0.3],
        ["predicted-latency", "concurrency 16", 700.0, 1.5, 0.9, 0.4],
        ["predicted-latency", "wrk, 16 connections", 800.0, "", 1.1, 0.3],
    ]
