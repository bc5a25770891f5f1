"""Flow control in the EndpointPickerConfig: off by default, plugins by reference, strict."""

from __future__ import annotations

import pytest

import epp.plugin_types  # noqa: F401  (registers every plugin type)
from epp.flowcontrol.config import build_flow_control
from epp.flowcontrol.fairness import LeastAttainedServiceFairness, RoundRobinFairness
from epp.flowcontrol.ordering import EarliestDeadlineOrdering, FcfsOrdering
from epp.flowcontrol.saturation import QueueKvSaturationDetector, TokenLoadSaturationDetector
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.types import ApiKind, LLMRequest

BASE = "plugins:\n- type: queue-scorer\n"


def attach(yaml_text: str, context):
    config = EndpointPickerConfig.from_yaml(yaml_text)
    pipeline = build_pipeline(config, context)
    return build_flow_control(config, pipeline, context), pipeline


def test_flow_control_is_off_by_default(context):
    flow_control, _ = attach(BASE, context)
    assert flow_control is None


def test_the_feature_gate_alone_turns_it_on_with_the_defaults(context):
    flow_control, pipeline = attach("featureGates: [flowControl]\n" + BASE, context)
    assert flow_control is not None
    controller = flow_control.controller
    assert isinstance(controller.fairness, RoundRobinFairness)
    assert isinstance(controller.ordering, FcfsOrdering)
    assert [type(d) for d in controller.detectors] == [QueueKvSaturationDetector, TokenLoadSaturationDetector]
    assert pipeline.plugins["round-robin-fairness"] is controller.fairness


def test_policies_and_detectors_are_plugins_by_reference(context):
    flow_control, _ = attach(
        BASE
        + """- name: tight
  type: token-load-saturation-detector
  parameters: {maxTokensPerEndpoint: 4096}
flowControl:
  saturationDetectors: [tight]
  fairnessPolicy: least-attained-service-fairness
  orderingPolicy: earliest-deadline-ordering
  maxQueuedRequests: 50
  retryAfterSeconds: 3
  defaultBand: {maxRequests: 20, ttlSeconds: 10}
  bands:
  - {priority: -1, maxRequests: 5, ttlSeconds: 2}
""",
        context,
    )
    c = flow_control.controller
    [detector] = c.detectors
    assert detector.name == "tight" and detector.params.max_tokens_per_endpoint == 4096
    assert isinstance(c.fairness, LeastAttainedServiceFairness)
    assert isinstance(c.ordering, EarliestDeadlineOrdering)
    s = c.settings
    assert (s.max_queued, s.retry_after_s) == (50, 3)
    assert (s.limits(-1).max_requests, s.limits(-1).ttl_s) == (5, 2.0)
    assert (s.limits(7).max_requests, s.limits(7).ttl_s) == (20, 10.0)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("fairnessPolicy: fcfs-ordering", "'fcfs-ordering' is not a FairnessPolicy"),
        ("orderingPolicy: nope", "unknown plugin type 'nope'"),
        ("saturationDetectors: []", "saturationDetectors"),
        ("bands: [{priority: 1}, {priority: 1}]", "band 1 is listed twice"),
        ("maxQueuedRequest: 5", "maxQueuedRequest"),
    ],
)
def test_bad_flow_control_config_fails_naming_the_field(context, section, message):
    with pytest.raises(ConfigError, match=message):
        attach(BASE + "flowControl:\n  " + section + "\n", context)


def test_flow_request_takes_band_flow_and_booking_from_the_request(context):
    flow_control, _ = attach(BASE + "flowControl: {defaultOutputTokens: 300}\n", context)
    request = LLMRequest(
        "r",
        "llama",
        ApiKind.CHAT,
        [1] * 40,
        priority=-1,
        slo_ttft_ms=250.0,
        headers={"x-gateway-inference-fairness-id": "tenant-b"},
    )
    item = flow_control.flow_request(request, received_at=5.0)
    assert (item.band, item.flow, item.tokens, item.slo_deadline) == (
        -1,
        "tenant-b",
        340,
        5.25,
    )
    request.headers, request.max_tokens = {}, 16
    second = flow_control.flow_request(request, received_at=5.0)
    assert (second.flow, second.tokens) == ("llama", 56) and second.key != item.key
