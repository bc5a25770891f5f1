"""Two active-active EPPs behind one Envoy, synced through a real nats-server: requests spread
over both, each EPP's token load shows the other's bookings, and everything returns to zero."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from epp.datalayer.metrics import TOKEN_LOAD_GAUGES
from epp.sync.metrics import REMOTE_TOKEN_SHARE
from sim.envoy_admin import is_healthy
from sim.nats_server import start_nats_server
from tests.stacks import start_stack
from tests.support import PROSE_WORDS, metric_sum, scrape, wait_for

pytestmark = pytest.mark.integration

LOAD_GAUGES = (*TOKEN_LOAD_GAUGES, REMOTE_TOKEN_SHARE)


def stream_completion(url: str, i: int) -> int:
    body = {
        "model": "tiny",
        "prompt": f"story {i}: " + "routers and caches " * 20,
        "max_tokens": 300,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as response:
        for _ in response.iter_lines():
            pass
        return response.status_code


def load_gauges(url: str) -> dict[str, float]:
    return {f"{s.name}{s.labels}": s.value for s in scrape(url) if s.name in LOAD_GAUGES}


def test_two_synced_epps_share_token_load_and_release_it(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", epp_replicas=2)
    try:
        epp0, epp1 = stack.epp_metrics_urls
        assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in (epp0, epp1)))
        url = f"{stack.gateway_url}/v1/completions"
        with ThreadPoolExecutor(8) as pool:
            statuses = pool.map(stream_completion, [url] * 8, range(8))
            # While the streams run, each EPP scores with the other's bookings.
            for epp in (epp0, epp1):
                assert wait_for(lambda e=epp: metric_sum(e, REMOTE_TOKEN_SHARE) > 0), epp
            assert list(statuses) == [200] * 8
        served = [metric_sum(u, "inference_objective_request_total") for u in (epp0, epp1)]
        assert sum(served) == 8 and min(served) >= 1, served  # Envoy spread the streams over both
        for epp in (epp0, epp1):
            # The peer's totals per endpoint (coalesced: not one per request, at least its
            # routing and its releases).
            assert metric_sum(epp, "llm_epp_sync_deltas_applied_total", kind="totals") >= 2
            assert wait_for(lambda e=epp: not any(load_gauges(e).values())), load_gauges(epp)
            assert metric_sum(epp, "llm_epp_sync_connected") == 1
    finally:
        stack.stop()


def envoy_sees_healthy(admin_port: int, epp_grpc_port: int) -> bool:
    return is_healthy(admin_port, "epp", f"127.0.0.1:{epp_grpc_port}")


def test_a_killed_epp_gets_no_new_streams_and_its_bookings_leave_the_survivor(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", epp_replicas=2)
    try:
        survivor = stack.epp_metrics_urls[0]
        admin = stack.config.ports.envoy_admin
        (_, _, _), (doomed_grpc, _, _) = stack.epp_ports
        assert wait_for(lambda: envoy_sees_healthy(admin, doomed_grpc))
        assert wait_for(lambda: metric_sum(survivor, "llm_epp_sync_peers_alive") == 1)
        url = f"{stack.gateway_url}/v1/completions"
        with ThreadPoolExecutor(4) as pool:
            # The streams the dead replica held fail (FailClose); the benchmarks count those.
            running = [pool.submit(stream_completion, url, i) for i in range(4)]
            assert wait_for(lambda: metric_sum(survivor, REMOTE_TOKEN_SHARE) > 0)
            stack.epps[1].stop(signal.SIGKILL)  # dies holding the bookings of what it routed
            # Within the peer timeout (3 s) and a heartbeat (0.5 s), with 1 s to spare, the
            # survivor drops the dead replica and every token it had booked.
            assert wait_for(lambda: metric_sum(survivor, "llm_epp_sync_peers_expired_total") == 1, 4.5)
            assert metric_sum(survivor, REMOTE_TOKEN_SHARE) == 0
            for stream in running:
                stream.exception()
        assert wait_for(lambda: not envoy_sees_healthy(admin, doomed_grpc))
        before = metric_sum(survivor, "inference_objective_request_total")
        statuses = [stream_completion(url, i) for i in range(6)]
        assert statuses == [200] * 6
        assert metric_sum(survivor, "inference_objective_request_total") == before + 6
        # The dead replica's bookings leave the survivor's token load after the peer timeout.
        assert wait_for(lambda: not any(load_gauges(survivor).values()), timeout=15), load_gauges(survivor)
        assert metric_sum(survivor, "llm_epp_sync_peers_alive") == 0
        assert metric_sum(survivor, "llm_epp_sync_peers_expired_total") == 1
    finally:
        stack.stop()


def completions_until(url: str, stop: threading.Event) -> list[int | str]:
    """Short completions one after another until ``stop``; each one's status, or its error."""
    outcomes: list[int | str] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"drain {len(outcomes)}", "max_tokens": 4}
            try:
                outcomes.append(client.post(url, json=body).status_code)
            except httpx.HTTPError as exc:
                outcomes.append(repr(exc))
    return outcomes


def test_a_sigterm_drains_the_epp_so_no_request_fails_under_fail_close(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, sim_profile="instant", epp_replicas=2, failure_mode="FailClose")
    try:
        admin = stack.config.ports.envoy_admin
        (_, _, _), (doomed_grpc, _, doomed_metrics) = stack.epp_ports
        assert wait_for(lambda: envoy_sees_healthy(admin, doomed_grpc))
        doomed = f"http://127.0.0.1:{doomed_metrics}/metrics"
        url = f"{stack.gateway_url}/v1/completions"
        stop = threading.Event()
        with ThreadPoolExecutor(4) as pool:
            loads = [pool.submit(completions_until, url, stop) for _ in range(4)]
            assert wait_for(lambda: metric_sum(doomed, "inference_objective_request_total") >= 20)
            stack.epps[1].stop(signal.SIGTERM, timeout=30)  # returns once it has exited
            survivor = stack.epp_metrics_urls[0]
            after = metric_sum(survivor, "inference_objective_request_total")
            assert wait_for(lambda: metric_sum(survivor, "inference_objective_request_total") >= after + 20)
            stop.set()
            outcomes = [o for load in loads for o in load.result()]
        assert stack.epps[1].process.returncode == 0, stack.epps[1].log_tail()
        assert "draining: NOT_SERVING" in stack.epps[1].log_tail(100)
        assert len(outcomes) >= 40
        assert [o for o in outcomes if o != 200] == []
    finally:
        stack.stop()


def timed_completions_until(url: str, stop: threading.Event) -> list[tuple[float, float, int, str]]:
    """Like :func:`completions_until`: (sent, ended, status, body) of each; status 0: no reply."""
    outcomes: list[tuple[float, float, int, str]] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"kill {len(outcomes)}", "max_tokens": 4}
            sent = time.monotonic()
            try:
                reply = client.post(url, json=body)
                outcomes.append((sent, time.monotonic(), reply.status_code, reply.text))
            except httpx.HTTPError as exc:
                outcomes.append((sent, time.monotonic(), 0, repr(exc)))
    return outcomes


@pytest.mark.parametrize("failure_mode", ["FailOpen", "FailClose"])
def test_killing_an_epp_under_load_fails_at_most_its_streams_and_only_within_a_second(
    tmp_path: Path, failure_mode: str
) -> None:
    stack = start_stack(
        tmp_path, replicas=2, sim_profile="instant", epp_replicas=2, failure_mode=failure_mode
    )
    try:
        admin = stack.config.ports.envoy_admin
        (_, _, _), (doomed_grpc, _, doomed_metrics) = stack.epp_ports
        assert wait_for(lambda: envoy_sees_healthy(admin, doomed_grpc))
        doomed, survivor = f"http://127.0.0.1:{doomed_metrics}/metrics", stack.epp_metrics_urls[0]
        url = f"{stack.gateway_url}/v1/completions"
        stop = threading.Event()
        with ThreadPoolExecutor(4) as pool:
            loads = [pool.submit(timed_completions_until, url, stop) for _ in range(4)]
            assert wait_for(lambda: metric_sum(doomed, "inference_objective_request_total") >= 20)
            killed_at = time.monotonic()
            stack.epps[1].stop(signal.SIGKILL)
            after = metric_sum(survivor, "inference_objective_request_total")
            assert wait_for(lambda: metric_sum(survivor, "inference_objective_request_total") >= after + 40)
            stop.set()
            outcomes = [o for load in loads for o in load.result()]
        failed = [
            (sent - killed_at, ended - killed_at, status, body)
            for sent, ended, status, body in outcomes
            if status != 200
        ]
        if failure_mode == "FailOpen":
            assert failed == []
            return
        # The streams it held (one per client at most) and the few Envoy opened to it before
        # outlier detection ejected it (2 refused connections), all sent before or within a
        # second of the kill; each answered one with an OpenAI-shaped JSON error.
        assert len(failed) <= 4 + 2, failed
        for sent, _, status, body in failed:
            assert sent <= 1.0, failed
            if status:
                assert status >= 500 and "message" in json.loads(body)["error"], (status, body)
    finally:
        stack.stop()


def test_cancelled_streams_over_both_epps_leave_no_token_load_on_either(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", epp_replicas=2)
    try:
        epps = stack.epp_metrics_urls
        assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in epps))
        url = f"{stack.gateway_url}/v1/completions"

        def cancelled(i: int) -> int:
            body = {
                "model": "tiny",
                "prompt": f"soak {i} " + "cache " * 50,
                "max_tokens": 500,
                "stream": True,
            }
            with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
                for n, _ in enumerate(response.iter_lines()):
                    if n >= 2 + i % 5:  # hang up a few tokens in, at different points
                        break
                return response.status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(cancelled, range(40))) == [200] * 40
        served = [metric_sum(u, "inference_objective_request_total") for u in epps]
        assert sum(served) == 40 and min(served) >= 5, served
        for epp in epps:
            assert wait_for(lambda e=epp: not any(load_gauges(e).values())), load_gauges(epp)
    finally:
        stack.stop()


def test_a_nats_outage_under_load_fails_nothing_and_the_replicas_converge_after(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", epp_replicas=2)
    try:
        epps = stack.epp_metrics_urls
        assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in epps))
        url = f"{stack.gateway_url}/v1/completions"
        stop = threading.Event()

        def streams_until() -> list[int]:
            statuses = []
            while not stop.is_set():
                statuses.append(stream_completion(url, len(statuses)))
            return statuses

        with ThreadPoolExecutor(4) as pool:
            loads = [pool.submit(streams_until) for _ in range(4)]
            share = REMOTE_TOKEN_SHARE
            assert wait_for(lambda: all(metric_sum(u, share) > 0 for u in epps))
            assert stack.nats is not None
            stack.nats.stop()
            assert wait_for(lambda: all(metric_sum(u, "llm_epp_sync_connected") == 0 for u in epps))
            installed = [metric_sum(u, "llm_epp_sync_snapshots_total", outcome="installed") for u in epps]
            time.sleep(10)  # the outage, under load
            # Each kept the peer's last known bookings, and expired no one.
            assert all(
                metric_sum(u, share) > 0 and metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in epps
            )
            stack.nats = start_nats_server(stack.workdir, stack.config.ports.nats, name="nats-again")
            for u, before in zip(epps, installed, strict=True):
                assert wait_for(lambda u=u: metric_sum(u, "llm_epp_sync_connected") == 1), u
                assert wait_for(
                    lambda u=u, b=before: (
                        metric_sum(u, "llm_epp_sync_snapshots_total", outcome="installed") > b
                    )
                ), u
            stop.set()
            statuses = [s for load in loads for s in load.result()]
        assert statuses and set(statuses) == {200}
        # Converged: the bookings released during the outage left each peer's view too.
        for epp in epps:
            assert wait_for(lambda e=epp: not any(load_gauges(e).values())), load_gauges(epp)
    finally:
        stack.stop()


def test_two_synced_epps_sampling_their_tokenizer_route_on_one_ratio(tmp_path: Path) -> None:
    """``--tokenize-every``: each EPP calibrates its estimate on its own share of the prompts, and
    the heartbeats bring both to one ratio, so the prefix blocks they share hash alike."""
    stack = start_stack(
        tmp_path, replicas=2, sim_profile="instant", epp_replicas=2, epp_args=["--tokenize-every", "2"]
    )
    sent = iter(range(10**6))

    def send(count: int) -> None:
        with httpx.Client(timeout=30) as client:
            for i in (next(sent) for _ in range(count)):
                prompt = " ".join(PROSE_WORDS[(i * 7 + k) % len(PROSE_WORDS)] for k in range(60)) + f" {i}"
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                assert client.post(f"{stack.gateway_url}/v1/completions", json=body).status_code == 200

    def ratios() -> list[float]:
        return [metric_sum(u, "llm_epp_tokenizer_bytes_per_token") for u in stack.epp_metrics_urls]

    try:
        assert wait_for(
            lambda: all(metric_sum(u, "llm_epp_sync_peers_alive") == 1 for u in stack.epp_metrics_urls)
        )
        send(300)  # over both EPPs: a window of 64 sampled prompts each
        assert all(
            metric_sum(u, "llm_epp_tokenizer_sampled_prompts_total") >= 64 for u in stack.epp_metrics_urls
        )
        # A follower looks its peers' ratio up on its next sampled prompt.
        assert wait_for(lambda: send(4) or len(set(ratios())) == 1, timeout=20), ratios()
        assert ratios()[0] < 3.6  # the tiny model's text: not the fixed 4 bytes a token
    finally:
        stack.stop()
