"""Builds flow control from an EndpointPickerConfig."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypeVar

from pydantic import ValidationError

from epp.flowcontrol.controller import BandLimits, FlowController, FlowSettings
from epp.flowcontrol.fairness import FairnessPolicy
from epp.flowcontrol.ordering import OrderingPolicy
from epp.flowcontrol.prefix import PrefixEstimate
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.spec import FEATURE_GATE, FlowControlSpec
from epp.flowcontrol.types import FAIRNESS_ID_HEADER, FlowRequest
from epp.scheduling.config import ConfigError, EndpointPickerConfig, PluginSpec, instantiate
from epp.scheduling.framework import Plugin, PluginContext
from epp.scheduling.pipeline import Pipeline
from epp.scheduling.types import LLMRequest

P = TypeVar("P", bound=Plugin)


class FlowControl:
    """The configured controller, and how requests become its :class:`FlowRequest` s. Drivers
    (the live gate, the fleet simulator's) hold a request's key from enqueue to finish."""

    def __init__(self, spec: FlowControlSpec, controller: FlowController) -> None:
        self.spec = spec
        self.controller = controller
        self._keys = itertools.count()

    def flow_request(self, request: LLMRequest, received_at: float) -> FlowRequest:
        """What flow control knows of ``request``, under a fresh key: band from its resolved
        priority, flow from the fairness id (else the model), and the tokens dispatching it books."""
        flow = request.headers.get(FAIRNESS_ID_HEADER) or request.model
        default = self.spec.default_output_tokens
        output = default if request.max_tokens is None else min(request.max_tokens, default)
        return FlowRequest(
            key=next(self._keys),
            band=request.priority,
            flow=flow,
            tokens=request.input_tokens + output,
            prompt_tokens=request.input_tokens,
            received_at=received_at,
            slo_ttft_ms=request.slo_ttft_ms,
            block_hashes=() if (prefix := self.controller.prefix) is None else prefix.block_hashes(request),
        )


def _resolve(ref: str, kind: type[P], plugins: dict[str, Plugin], context: PluginContext) -> P:
    plugin = plugins.get(ref)
    if plugin is None:
        plugin = plugins[ref] = instantiate(PluginSpec(type=ref), context)
    if not isinstance(plugin, kind):
        raise ConfigError(f"flowControl: {ref!r} is not a {kind.__name__}")
    return plugin


def _settings(spec: FlowControlSpec) -> FlowSettings:
    bands = {}
    for band in spec.bands:
        if band.priority in bands:
            raise ConfigError(f"flowControl: band {band.priority} is listed twice")
        bands[band.priority] = BandLimits(band.max_requests, band.ttl_seconds)
    default = BandLimits(spec.default_band.max_requests, spec.default_band.ttl_seconds)
    return FlowSettings(bands, default, spec.max_queued_requests, spec.retry_after_seconds)


def flow_control_spec(config: EndpointPickerConfig) -> FlowControlSpec | None:
    """``config``'s ``flowControl`` section, parsed; the defaults where only its feature gate is
    on; None when it is off. Raises :class:`ConfigError` naming what is wrong in it."""
    if config.flow_control is None:
        return FlowControlSpec() if FEATURE_GATE in config.feature_gates else None
    try:
        return FlowControlSpec.model_validate(config.flow_control)
    except ValidationError as exc:
        raise ConfigError(f"invalid EndpointPickerConfig: flowControl: {exc}") from exc


def build_flow_control(
    config: EndpointPickerConfig, pipeline: Pipeline, context: PluginContext
) -> FlowControl | None:
    """The flow control ``config`` asks for, its plugins taken from (or added to) ``pipeline``'s;
    None when it is off (the default)."""
    spec = flow_control_spec(config)
    if spec is None:
        return None
    plugins = pipeline.plugins
    detectors: Sequence[SaturationDetector] = [
        _resolve(ref, SaturationDetector, plugins, context) for ref in spec.saturation_detectors
    ]
    controller = FlowController(
        _settings(spec),
        _resolve(spec.fairness_policy, FairnessPolicy, plugins, context),
        _resolve(spec.ordering_policy, OrderingPolicy, plugins, context),
        detectors,
    )
    if any(d.uses_prefix_estimate() for d in detectors):
        controller.prefix = PrefixEstimate.of(plugins.values())
    return FlowControl(spec, controller)
