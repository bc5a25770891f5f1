"""The trainer as a real process: loopback only by default, its probe-only listener on every
interface, and exposed only with a token that the EPP's client sends.

The non-loopback address is this machine's own first global IPv4 address (``ip -4 -o addr show
scope global``; on the development machines eth0's, e.g. 192.0.2.2): a connection to it comes
in on that interface, not on ``lo``, as one from another pod would reach a pod IP.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from sim.processes import BIN, Component, free_port, http_ok, spawn, wait_until
from tests.epp.factories import client_for
from tests.trainer.synthetic import training_samples

pytestmark = pytest.mark.integration
TOKEN = "integration-token"


def non_loopback_address() -> str:
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True, check=True
    ).stdout
    addresses = [line.split()[3].split("/")[0] for line in out.splitlines()]
    assert addresses, "this test needs one non-loopback IPv4 address on the machine (ip -4 addr)"
    return addresses[0]


def start_trainer(tmp_path: Path, name: str, *args: str) -> tuple[Component, int]:
    port = free_port()
    argv = [str(BIN / "llm-epp-trainer"), "--port", str(port), "--model-dir", str(tmp_path / name), *args]
    return spawn(name, argv, tmp_path), port


def test_the_default_trainer_refuses_connections_from_beyond_loopback(tmp_path: Path) -> None:
    address = non_loopback_address()
    health_port = free_port()
    trainer, port = start_trainer(tmp_path, "trainer", "--health-port", str(health_port))
    try:
        wait_until(trainer, http_ok(f"http://127.0.0.1:{port}/healthz"))
        # The probe-only listener answers kubelet on the pod address...
        wait_until(trainer, http_ok(f"http://{address}:{health_port}/readyz"))
        assert httpx.get(f"http://{address}:{health_port}/healthz").json() == {"status": "ok"}
        # ...and Prometheus there (read-only metrics)...
        assert "trainer_model_version" in httpx.get(f"http://{address}:{health_port}/metrics").text
        sample = {"entries": training_samples(1)}
        assert (
            httpx.post(f"http://{address}:{health_port}/add_training_data_bulk", json=sample).status_code
            == 404
        )
        # ...while the API port is closed there: the kernel refuses the connection.
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"http://{address}:{port}/add_training_data_bulk", json=sample, timeout=5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{address}:{port}/model/download/info", timeout=5)
        assert httpx.post(f"http://127.0.0.1:{port}/add_training_data_bulk", json=sample).status_code == 202
    finally:
        trainer.stop()


def test_an_exposed_trainer_needs_a_token_file(tmp_path: Path) -> None:
    trainer, _ = start_trainer(tmp_path, "trainer", "--host", "0.0.0.0")
    assert trainer.process.wait(30) == 2  # argparse's usage error
    assert "--auth-token-file" in trainer.log_tail()


async def test_an_exposed_trainer_takes_samples_only_with_its_token(tmp_path: Path) -> None:
    address = non_loopback_address()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    trainer, port = start_trainer(
        tmp_path, "trainer", "--host", "0.0.0.0", "--auth-token-file", str(token_file)
    )
    url = f"http://{address}:{port}"
    try:
        wait_until(trainer, http_ok(f"{url}/healthz"))
        sample = {"entries": training_samples(3)}
        assert httpx.post(f"{url}/add_training_data_bulk", json=sample).status_code == 401
        bad = httpx.post(f"{url}/add_training_data_bulk", json=sample, headers={"Authorization": "Bearer x"})
        assert bad.status_code == 401
        # The EPP's own client, given the token, gets its samples in.
        client = await client_for([url], trainer=url, trainer_token=TOKEN)
        try:
            client.add_training(training_samples(4))
            assert await client.flush_training() == 4
        finally:
            await client.close()
        status = httpx.get(f"{url}/data/status").json()
        assert status["models"]["ttft"]["added_total"] == 4
    finally:
        trainer.stop()
