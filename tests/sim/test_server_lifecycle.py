"""Client disconnects, engine failures, and the command line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sim.driver import MAX_TIMELINE_LAG_S, timeline_time
from sim.openai_serving import ServedModel
from sim.server import build_parser, main, settings_from_args
from tests.support import eventually, sample_value

from .conftest import running_replica


async def test_disconnect_mid_stream_aborts_and_frees_blocks(served_model: ServedModel) -> None:
    async with running_replica(served_model, profile="default") as (replica, url):
        engine = replica.engine
        payload = {"prompt": "hello " * 200, "max_tokens": 2000, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=payload) as response:
                lines = response.aiter_lines()
                first = json.loads((await anext(lines)).removeprefix("data: "))
                request = engine.get_request(first["id"])
                assert request is not None and engine.kv_usage > 0
            # Leaving the block closed the connection mid-stream.
            await eventually(lambda: not engine.has_unfinished_requests())
        assert request.finish_reason == "abort"
        assert request.num_output_tokens < 2000
        assert engine.kv_usage == 0.0


async def test_disconnect_before_a_whole_response_aborts(served_model: ServedModel) -> None:
    async with running_replica(served_model, profile="default") as (replica, url):
        engine = replica.engine
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2000})
        await eventually(lambda: not engine.has_unfinished_requests())
        assert engine.kv_usage == 0.0
        assert engine.counters.generation_tokens < 2000


async def test_a_failing_engine_loop_answers_500_without_a_trace(
    served_model: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_replica(served_model) as (replica, url), httpx.AsyncClient(base_url=url) as http:

        def broken(step: object, now: float) -> None:
            raise ValueError("simulated bug")

        monkeypatch.setattr(replica.engine, "finish_step", broken)
        for payload in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
            response = await http.post("/v1/completions", json=payload)
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "InternalServerError"
            assert "Traceback" not in response.text
        assert (await http.get("/health")).status_code == 200


def test_cli_settings() -> None:
    argv = [
        "--profile",
        "instant",
        "--num-gpu-blocks",
        "100",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
    ]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.profile == "instant"
    assert settings.engine_overrides == {
        "num_gpu_blocks": 100,
        "block_size": 32,
        "enable_prefix_caching": False,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--replicas", "0"],
        ["--profile", "no-such-profile"],
        ["--block-size", "0"],
        ["--model-dir", "/nonexistent"],
    ],
)
def test_cli_rejects_bad_settings(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def test_cli_serves_replicas_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port_pair()
    kv_events = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp_path}/kv.sock"}}'
    command = [
        *(sys.executable, "-m", "sim.server", "--port", str(port), "--replicas", "2"),
        *("--kv-events-config", kv_events),
    ]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen([*command, "--profile", "instant"], stdout=log, stderr=subprocess.STDOUT)
    try:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        for _ in range(600):
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if all(httpx.get(f"{url}/health").status_code == 200 for url in urls):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise AssertionError(f"replicas did not come up:\n{(tmp_path / 'server.log').read_text()}")
        for url in urls:
            done = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()
            assert done["usage"]["completion_tokens"] == 3
        # Independent engines: each counted only its own request, each publishes KV events on its own
        # endpoint (the second one's derived from the flag's).
        for index, url in enumerate(urls):
            text = httpx.get(f"{url}/metrics").text
            assert sample_value(text, "vllm:generation_tokens_total", engine="0", model_name="tiny") == 3.0
            endpoint = httpx.get(f"{url}/kv_event_sources").json()["0"]["endpoint"]
            assert endpoint == f"ipc://{tmp_path}/kv.sock" + ("_dp1" if index else "")
            assert Path(endpoint.removeprefix("ipc://")).is_socket()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_steps_follow_the_engine_timeline_unless_far_behind() -> None:
    assert timeline_time(10.0, None) == 10.0  # idle: start now
    assert timeline_time(10.0008, 10.0) == 10.0  # woke 0.8 ms late: keep the planned time
    assert timeline_time(10.0008, 10.0, not_before=10.0005) == 10.0005  # never before a submit
    assert timeline_time(10.0 + 2 * MAX_TIMELINE_LAG_S, 10.0) == 10.0 + 2 * MAX_TIMELINE_LAG_S
