"""The request lifecycle: bookings, the order observers hear each step in, one outcome per request."""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import pytest

from epp.configs import config_path
from epp.latency.report import PredictionReport
from epp.plugins.token_load import find_token_load
from epp.requestcontrol.lifecycle import ENDPOINT_HEADER, RequestLifecycle
from epp.scheduling.config import EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import Plugin, PluginContext, RequestOutcome
from epp.scheduling.observers import LifecycleObserver, RoutedRequest
from epp.scheduling.predictor import Prediction
from tests.epp.factories import FakeClock, endpoint_state, make_request, run

REPO = Path(__file__).resolve().parents[2]


class ConstantPredictor:
    async def predict(self, rows: list[dict[str, Any]]) -> list[Prediction]:
        return [Prediction(120.0, 15.0) for _ in rows]

    def add_training(self, samples: Any) -> None:
        self.samples = list(samples)


class Heard(LifecycleObserver):
    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log = log

    def on_routed(self, routed: RoutedRequest, now: float) -> None:
        self.log.append(("observer", "routed", str(now)))

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        self.log.append(("observer", "first", str(now)))

    def on_progress(self, routed: RoutedRequest, tokens: int, now: float) -> None:
        self.log.append(("observer", "progress", str(tokens)))

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self.log.append(("observer", "finished", str(outcome.finished_at)))


class PluginHeard(Plugin, LifecycleObserver):
    type_name = "test-heard"

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        super().__init__("heard", None, PluginContext(clock=FakeClock()))  # type: ignore[arg-type]
        self.log = log

    def on_first_token(self, routed: RoutedRequest, now: float) -> None:
        self.log.append(("plugin", "first", str(now)))

    def on_finished(self, routed: RoutedRequest, outcome: RequestOutcome) -> None:
        self.log.append(("plugin", "finished", str(outcome.finished_at)))


def lifecycle(config: str = "gie-default", *observers: LifecycleObserver) -> RequestLifecycle:
    context = PluginContext(clock=FakeClock(), rng=random.Random(0), latency_predictor=ConstantPredictor())  # type: ignore[arg-type]
    pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path(config)), context)
    return RequestLifecycle(pipeline, observers)


def test_a_request_is_booked_while_routed_and_released_once() -> None:
    lc = lifecycle()
    endpoints = [endpoint_state(0), endpoint_state(1)]
    routed = run(lc.route(make_request(list(range(40))), endpoints, 1.0, 1.5))
    assert routed.booked in endpoints and routed.booked.in_flight == 1
    assert sum(e.in_flight for e in endpoints) == 1
    outcome = lc.finished(routed, 3.0, status=200, completed=True, streaming=False, completion_tokens=None)
    assert routed.booked.in_flight == 0 and routed.outcome is outcome
    assert (outcome.received_at, outcome.finished_at, outcome.endpoint) == (1.0, 3.0, routed.result.endpoint)
    again = lc.finished(routed, 9.0, status=500, completed=False, streaming=False, completion_tokens=None)
    assert again is outcome and routed.booked.in_flight == 0


def test_plugins_hear_each_step_before_the_lifecycle_observers_and_nothing_after_the_end() -> None:
    log: list[tuple[str, ...]] = []
    pipeline = lifecycle().pipeline
    pipeline.observers.insert(0, PluginHeard(log))
    lc = RequestLifecycle(pipeline, [Heard(log)])
    routed = run(lc.route(make_request(list(range(40))), [endpoint_state(0)], 1.0, 1.0))
    lc.first_token(routed, 2.0)
    lc.first_token(routed, 2.5)  # a second "first" token is not one
    lc.progress(routed, 4, 2.5)
    lc.finished(routed, 4.0, status=200, completed=True, streaming=True, completion_tokens=4)
    lc.progress(routed, 5, 4.5)
    assert log == [
        ("observer", "routed", "1.0"),
        ("plugin", "first", "2.0"),
        ("observer", "first", "2.0"),
        ("observer", "progress", "4"),
        ("plugin", "finished", "4.0"),
        ("observer", "finished", "4.0"),
    ]
    assert routed.outcome is not None and routed.outcome.first_token_at == 2.0
    assert routed.outcome.tpot_s == pytest.approx(2.0 / 3)
    assert lc.wants_progress


def test_debug_headers_name_the_endpoint_and_the_prediction_report_adds_the_predictions() -> None:
    plain = lifecycle()
    routed = run(plain.route(make_request(list(range(40))), [endpoint_state(0)], 0.0, 0.0))
    assert plain.debug_headers(routed) == {ENDPOINT_HEADER: routed.endpoint_name}
    assert not plain.wants_progress

    predicted = lifecycle("predicted-latency", PredictionReport(None))
    request = make_request(list(range(40)))
    routed = run(predicted.route(request, [endpoint_state(0), endpoint_state(1)], 0.0, 0.0))
    headers = predicted.debug_headers(routed)
    assert headers[ENDPOINT_HEADER] == routed.endpoint_name
    assert headers["x-llm-epp-predicted-ttft-ms"] == "120.000"
    assert headers["x-llm-epp-candidates-ttft-ms"] == "e0=120.0,e1=120.0"


def _imports(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


def test_request_control_reads_no_latency_module_and_the_data_layer_no_epp_metrics() -> None:
    assert not {n for n in _imports(REPO / "epp" / "requestcontrol") if n.startswith("epp.latency")}
    assert "epp.metrics" not in _imports(REPO / "epp" / "datalayer")


def test_a_request_served_elsewhere_is_rebooked_there_for_the_plugins_and_the_observers() -> None:
    log: list[tuple[str, ...]] = []

    class Rebooked(Heard):
        def on_rebooked(self, routed: RoutedRequest, previous, now: float) -> None:
            log.append(("observer", "rebooked", previous.endpoint.name, routed.endpoint_name))

    lc = lifecycle("ray-kv-aware", Rebooked(log))
    token_load = find_token_load(lc.pipeline.plugins.values())
    assert token_load is not None
    tracker = token_load.tracker
    endpoints = [endpoint_state(0), endpoint_state(1)]
    routed = run(lc.route(make_request(list(range(64))), endpoints, 0.0, 0.0))
    first = routed.booked
    (other,) = [e for e in endpoints if e is not first]
    booked = tracker.load(first.name)
    assert booked.requests == 1
    lc.rebooked(routed, other, 0.2)
    assert (first.in_flight, other.in_flight) == (0, 1) and routed.booked is other
    assert routed.result.endpoint == other.endpoint and first.endpoint in routed.result.targets
    assert tracker.load(first.name).requests == 0 and tracker.load(other.name) == booked
    assert log[-1] == ("observer", "rebooked", first.name, other.name)
    lc.first_token(routed, 0.3)
    lc.rebooked(routed, first, 0.4)  # too late: a token came from ``other``
    assert routed.booked is other and tracker.load(first.name).requests == 0
    lc.finished(routed, 1.0, status=200, completed=True, streaming=True, completion_tokens=2)
    assert tracker.in_flight() == 0 and other.in_flight == 0
