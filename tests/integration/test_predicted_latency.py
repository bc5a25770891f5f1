"""Predicted-latency routing end to end: real Envoy, the EPP, the trainer, two predictors and
simulated replicas with a small, slow engine (4 sequences at once, a 128k-token KV cache, the
default step times ×4) so that queues and KV pressure appear at test-sized loads and engine
time dominates the scheduling noise of a busy 2-core machine."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from sim.stack import LocalStack
from tests.latency_traffic import model_version, prompt, send, small_engine_profile
from tests.stacks import start_stack
from tests.support import metric_sum, wait_for

pytestmark = pytest.mark.integration


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's rho: the correlation of ranks, robust to a few scheduling-noise outliers."""
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


@pytest.fixture(scope="module")
def latency_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("latency")
    profile = small_engine_profile(workdir / "small.yaml")
    stack = start_stack(
        workdir, replicas=3, sim_profile=str(profile), predictors=2,
        trainer_args=["--retrain-interval-s", "1", "--min-samples", "60"],
    )  # fmt: skip
    # Warm up on a mix of prompt lengths and loads, so the model sees queues form and drain.
    with cf.ThreadPoolExecutor(24) as pool:
        list(pool.map(lambda i: send(stack, i, 20 + (i * 37) % 900, 4 + i % 48), range(480)))
    assert wait_for(lambda: model_version(stack) >= 2, timeout=60), "the trainer never produced a model"
    yield stack
    stack.stop()


def test_predictions_exist_and_track_actual_ttft(latency_stack: LocalStack) -> None:
    # One request at a time with prompts from 40 to ~9,000 tokens: prefill time, which the model
    # sees through the prompt length, decides TTFT rather than what else shares the replica.
    responses = [send(latency_stack, 1000 + i, 20 + (i * 911) % 5000, 8) for i in range(40)]
    assert all(r.status == 200 for r in responses)
    with_prediction = [r for r in responses if "x-llm-epp-predicted-ttft-ms" in r.headers]
    assert len(with_prediction) >= 38, "after warm-up nearly every request gets a prediction"
    predicted = [float(r.headers["x-llm-epp-predicted-ttft-ms"]) for r in with_prediction]
    actual = [r.ttft_ms for r in with_prediction]
    assert rank_correlation(predicted, actual) > 0.5
    url = latency_stack.epp_metrics_url
    assert metric_sum(url, "inference_objective_request_ttft_seconds_count") >= 440
    assert metric_sum(url, "inference_objective_request_predicted_ttft_seconds_count") >= 38


def load_directly(stack: LocalStack, replica: int, count: int) -> cf.ThreadPoolExecutor:
    """Keep ``count`` long requests running on one replica, bypassing the gateway. Their prompts
    are distinct and ~5,700 tokens long, so even one of them holds over 2% of the KV cache (the
    admitter treats an endpoint below that as nearly empty)."""
    pool = cf.ThreadPoolExecutor(count)
    url = f"{stack.replica_url(replica)}/v1/completions"
    for k in range(count):
        body = {"model": "tiny", "prompt": prompt(10_000 * (replica + 1) + k, 3000), "max_tokens": 150}
        pool.submit(httpx.post, url, json=body, timeout=120)
    return pool


def waiting(stack: LocalStack, replica: int) -> float:
    return metric_sum(stack.replica_url(replica) + "/metrics", "vllm:num_requests_waiting")


def candidate_ttft(response: httpx.Response) -> dict[str, float]:
    pairs = response.headers["x-llm-epp-candidates-ttft-ms"].split(",")
    return {name: float(ms) for name, ms in (p.split("=") for p in pairs)}


def queued_at_epp(stack: LocalStack, replica: int) -> float:
    """The queue length the EPP itself last scraped: it decides on its own view, not ours."""
    return metric_sum(
        stack.epp_metrics_url, "inference_pool_per_pod_queue_size", model_server_pod=f"replica-{replica}"
    )


def test_endpoint_predicted_to_violate_the_slo_is_avoided(latency_stack: LocalStack) -> None:
    hot, others = "replica-0", ["replica-1", "replica-2"]
    pool = load_directly(latency_stack, 0, 10)
    try:
        assert wait_for(lambda: queued_at_epp(latency_stack, 0) >= 4)
        avoided, explored = [], 0  # requests where the loaded replica alone was predicted to miss the SLO
        for i in range(20):
            # A fresh probe per request: predictions follow the queue as it drains, so a fixed
            # SLO would drift out of the gap between the loaded replica and the idle ones.
            probe = candidate_ttft(send(latency_stack, 2000 + 2 * i, 50, 4))
            if probe[hot] <= max(probe[o] for o in others):
                continue
            slo = (probe[hot] + max(probe[o] for o in others)) / 2
            r = send(latency_stack, 2001 + 2 * i, 50, 4, {"x-slo-ttft-ms": f"{slo:.0f}"})
            assert r.status == 200
            trace = json.loads(r.headers["x-llm-epp-decision"])
            headroom = {name: p["ttft_headroom_ms"] for name, p in trace["predictions"].items()}
            if not (headroom[hot] < 0 <= min(headroom[o] for o in others)):
                continue
            removed = sorted(trace["removed"].get("slo-headroom-tier-filter", []))
            if removed == others:  # the filter's exploration of the negative tier
                explored += 1
                assert r.headers["x-llm-epp-endpoint"] == hot, trace
            else:
                assert removed == [hot], trace
                avoided.append(r.headers["x-llm-epp-endpoint"])
        assert len(avoided) + explored >= 5, "the loaded replica should be predicted to miss the SLO"
        assert hot not in avoided, avoided
        # The filter explores the negative tier with probability 0.01: 3 or more times in 20 has
        # odds of about 1 in 1,000.
        assert explored <= 2
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_sheddable_requests_are_shed_when_saturated(latency_stack: LocalStack) -> None:
    pools = [load_directly(latency_stack, i, 10) for i in range(3)]
    try:
        # Wait until the EPP itself sees every replica queueing: it decides on its own scrapes.
        assert wait_for(lambda: all(queued_at_epp(latency_stack, i) >= 4 for i in range(3)))
        tight = {"x-slo-ttft-ms": "1", "x-llm-d-priority": "-1"}
        shed = send(latency_stack, 3000, 50, 4, tight)
        assert shed.status == 429, {k: v for k, v in shed.headers.items() if k.startswith("x-llm")}
        assert shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == 429
        assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        served = send(latency_stack, 3001, 50, 4, {**tight, "x-llm-d-priority": "0"})
        assert served.status == 200
    finally:
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def test_invalid_slo_header_is_a_400_naming_it(latency_stack: LocalStack) -> None:
    r = send(latency_stack, 4000, 10, 2, {"x-slo-ttft-ms": "soon"})
    assert r.status == 400 and "x-slo-ttft-ms" in r.json()["error"]["message"]


def test_killing_every_predictor_mid_load_falls_back_without_failures(latency_stack: LocalStack) -> None:
    fallbacks = "llm_epp_prediction_fallback_total"
    before = metric_sum(latency_stack.epp_metrics_url, fallbacks)
    with cf.ThreadPoolExecutor(6) as pool:
        first = [pool.submit(send, latency_stack, 5000 + i, 30 + i % 200, 6) for i in range(60)]
        cf.wait(first[:20])
        for predictor in latency_stack.predictors:
            predictor.stop(signal.SIGKILL)
        rest = [pool.submit(send, latency_stack, 6000 + i, 30 + i % 200, 6) for i in range(60)]
        statuses = [f.result().status for f in first + rest]
    assert statuses == [200] * 120
    assert metric_sum(latency_stack.epp_metrics_url, fallbacks) - before >= 40
