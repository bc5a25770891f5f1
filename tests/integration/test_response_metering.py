"""First-token metering through real Envoy: the EPP reads a streamed answer to its first token,
ends its ext_proc stream, and Envoy's gRPC access log finishes the request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from epp.datalayer.metrics import TOKEN_LOAD_GAUGES
from sim import envoy_config
from sim.envoy_admin import stat
from tests.stacks import start_stack
from tests.support import metric_sum, scrape, wait_for

pytestmark = pytest.mark.integration

MODEL_LABELS = {"model_name": "tiny", "target_model_name": "tiny"}
GAUGES = (
    *TOKEN_LOAD_GAUGES,
    "llm_epp_endpoint_in_flight_requests",
    "inference_objective_running_requests",
    "llm_epp_handed_off_requests",
)


def answer(client: openai.OpenAI, max_tokens: int) -> tuple[int, str | None, int | None]:
    """Stream a chat answer of ``max_tokens``; its content chunks, finish reason and usage count."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about routers."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    content, finish, usage = 0, None, None
    for chunk in stream:
        if chunk.choices:
            content += bool(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return content, finish, usage


def gauges(url: str) -> dict[str, float]:
    return {f"{s.name}{s.labels}": s.value for s in scrape(url) if s.name in GAUGES}


def test_whole_answers_arrive_and_the_access_log_finishes_them(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, replicas=2, epp_config="ray-kv-aware", response_metering="first-token")
    try:
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)
        lengths = [1, 16, 40, 64, 300, 512, 512, 200]
        for n in lengths:
            assert answer(client, n) == (n, "length", n)
        url = stack.epp_metrics_url
        # The model's first 4 streams are read to their end; the others end at their first token.
        assert wait_for(lambda: metric_sum(url, "llm_epp_access_log_entries_total", kind="final") == 4)
        assert metric_sum(url, "inference_objective_request_duration_seconds_count", **MODEL_LABELS) == 8
        assert metric_sum(url, "inference_objective_request_error_total") == 0
        counted = metric_sum(url, "inference_objective_output_tokens_sum", **MODEL_LABELS)
        assert counted == pytest.approx(sum(lengths), rel=0.02)  # the handed-off ones from their bytes
        assert not any(gauges(url).values()), gauges(url)
        # Envoy sent the EPP the chunks of 4 short streams (121 tokens) to their end and of 4
        # long ones (1,524 tokens) to their first token only: a few messages per request else.
        sent = stat(stack.config.ports.envoy_admin, "http.gateway.ext_proc.stream_msgs_sent")
        assert 121 < sent < 121 + 8 * 12, sent
    finally:
        stack.stop()


@pytest.mark.parametrize(
    ("metering", "callout"), [("first-token", "ext-proc"), ("full", "ext-proc"), ("first-token", "ext-authz")]
)
def test_300_cancelled_streams_leave_every_gauge_at_zero(tmp_path: Path, metering: str, callout: str) -> None:
    stack = start_stack(
        tmp_path, replicas=2, epp_config="ray-kv-aware", response_metering=metering, callout=callout
    )
    body = {"model": "tiny", "prompt": "a long story, please", "max_tokens": 400, "stream": True}

    def cancelled(i: int) -> int:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", f"{stack.gateway_url}/v1/completions", json={**body, "seed": i}
            ) as response,
        ):
            for n, _ in enumerate(response.iter_lines()):
                if n >= 4:  # past the first token: handed off, in first-token metering
                    break
            return response.status_code

    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            assert set(pool.map(cancelled, range(300))) == {200}
        url = stack.epp_metrics_url
        assert wait_for(lambda: not any(gauges(url).values()), timeout=20), gauges(url)
        aborted = metric_sum(url, "inference_objective_request_error_total")
        assert aborted >= 290, aborted  # every cancelled stream counted as not completed
        assert metric_sum(url, "llm_epp_handed_off_expired_total") == 0  # the log told of every one
    finally:
        stack.stop()


def test_envoys_periodic_entries_keep_a_long_stream_booked_past_the_silence_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream longer than --completion-log-silence-s stays booked while Envoy logs it every
    period, and its decode progress moves on meanwhile."""
    monkeypatch.setattr(envoy_config, "ACCESS_LOG_PERIOD", "0.5s")
    stack = start_stack(
        tmp_path,
        replicas=1,
        epp_config="ray-kv-aware",
        epp_args=["--completion-log-silence-s", "1.5", "--metering-calibration-streams", "1"],
    )
    url = f"{stack.gateway_url}/v1/completions"
    body = {"model": "tiny", "prompt": "a long story, please", "stream": True, "ignore_eos": True}
    decode = "llm_epp_endpoint_decode_tokens_in_flight"
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json={**body, "max_tokens": 20}) as response:
                assert sum(1 for _ in response.iter_lines()) > 20  # calibration: read whole
            seen: list[float] = []
            with client.stream("POST", url, json={**body, "max_tokens": 700}) as response:  # ~4 s
                for n, _ in enumerate(response.iter_lines()):
                    if n % 100 == 50:
                        seen.append(metric_sum(stack.epp_metrics_url, decode))
        metrics = stack.epp_metrics_url
        assert wait_for(lambda: metric_sum(metrics, "llm_epp_access_log_entries_total", kind="final") == 1)
        assert metric_sum(metrics, "llm_epp_access_log_entries_total", kind="intermediate") >= 3
        assert metric_sum(metrics, "llm_epp_handed_off_expired_total") == 0
        assert metric_sum(metrics, "inference_objective_request_error_total") == 0
        assert seen[-1] > seen[0] > 0, seen  # the booking's decode tokens grew while it streamed
        assert metric_sum(metrics, decode) == 0
    finally:
        stack.stop()
