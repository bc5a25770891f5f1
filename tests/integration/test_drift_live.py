"""Prediction drift live: real Envoy, the EPP, the trainer, a predictor and simulated engines that
slow down mid-run (``POST /admin/engine-speed``). The EPP must notice its live error, route on
heuristics (fallback reason ``drift``), ask the trainer to retrain, and route on predictions
again once a model trained on the slow engines is accurate. The times are printed (``-s``)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from epp.configs import config_path
from sim.stack import LocalStack
from tests.latency_traffic import Reply, model_version, send, small_engine_profile
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration
SLOWDOWN = 4.0


def drift_config(path: Path) -> Path:
    """The shipped predicted-latency config, judging drift over 30 requests: over 60% MAPE
    drifts (a model 4× too fast is 75% off), 45% or less recovers."""
    text = config_path("predicted-latency").read_text()
    tuned = (
        "    streamingMode: true\n    driftWindow: 30\n"
        "    driftMapeThreshold: 0.6\n    driftRecoverMapeThreshold: 0.45\n"
    )
    path.write_text(text.replace("    streamingMode: true\n", tuned))
    return path


class Load:
    """Keeps ``workers`` clients sending requests through the gateway until stopped."""

    def __init__(self, stack: LocalStack, workers: int) -> None:
        self.stack, self.replies, self._stop = stack, [], threading.Event()
        self._pool = cf.ThreadPoolExecutor(workers)
        self._next = iter(range(10**6))
        self._lock = threading.Lock()
        for _ in range(workers):
            self._pool.submit(self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i = next(self._next)
            reply = send(self.stack, 50_000 + i, 20 + (i * 37) % 600, 4 + i % 24)
            with self._lock:
                self.replies.append((time.monotonic(), reply))

    def since(self, t: float) -> list[Reply]:
        with self._lock:
            return [r for at, r in self.replies if at >= t]

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def drift_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("drift")
    stack = start_stack(
        workdir,
        replicas=2,
        sim_profile=str(small_engine_profile(workdir / "small.yaml")),
        predictors=1,
        epp_config=str(drift_config(workdir / "drift.yaml")),
        trainer_args=["--retrain-interval-s", "2", "--min-samples", "60"],
    )
    yield stack
    stack.stop()


def _fallback(reply: Reply) -> str | None:
    return reply.headers.get("x-llm-epp-prediction-fallback")


def test_engines_slowing_down_is_detected_falls_back_and_recovers(drift_stack: LocalStack) -> None:
    stack, url = drift_stack, drift_stack.epp_metrics_url
    load = Load(stack, workers=6)
    try:
        assert wait_for(lambda: model_version(stack) >= 1, timeout=120), "the trainer never produced a model"
        settled = time.monotonic()
        assert wait_for(
            lambda: len([r for r in load.since(settled) if _fallback(r) is None]) >= 60, timeout=120
        )
        assert metric_sum(url, "llm_epp_prediction_drifting") == 0
        assert metric_sum(url, "llm_epp_prediction_drift_episodes_total") == 0
        version_before = model_version(stack)

        switched = time.monotonic()
        for replica in range(2):
            answer = httpx.post(
                f"{stack.replica_url(replica)}/admin/engine-speed", json={"slowdown": SLOWDOWN}
            )
            assert answer.status_code == 200
        assert wait_for(lambda: metric_sum(url, "llm_epp_prediction_drifting") == 1, timeout=120)
        detected = time.monotonic()
        assert wait_for(lambda: any(_fallback(r) == "drift" for r in load.since(detected)), timeout=30)
        assert metric_sum(url, "llm_epp_prediction_fallback_total", reason="drift") > 0
        # The EPP asked for a retrain, and the trainer published a model trained on slow engines.
        assert wait_for(lambda: metric_sum(url, "llm_epp_prediction_drifting") == 0, timeout=240)
        recovered = time.monotonic()
        assert model_version(stack) > version_before
        after = time.monotonic()
        assert wait_for(lambda: len(load.since(after)) >= 10, timeout=60)
        back = [r for r in load.since(after) if _fallback(r) is None]
        assert back and all("x-llm-epp-predicted-ttft-ms" in r.headers for r in back)
        decision = json.loads(back[-1].headers["x-llm-epp-decision"])
        assert decision["model_version"] > version_before and decision["fallback"] is None
        print(
            f"\nengines {SLOWDOWN:g}x slower at t=0: drift detected at {detected - switched:.1f} s, "
            f"predictions back (model v{version_before} -> v{decision['model_version']}) at "
            f"{recovered - switched:.1f} s"
        )
    finally:
        load.stop()
