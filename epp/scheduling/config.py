"""``EndpointPickerConfig``: the YAML that assembles plugins into a scheduling pipeline.

Compatible with the llm-d / Gateway API Inference Extension format::

    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: queue-scorer
    - name: prefix
      type: prefix-cache-scorer
      parameters: {blockSizeTokens: 64}
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: prefix
        weight: 3

Decoding is strict: unknown fields, plugin types, parameters and references fail at start-up
with a message that names them. Defaults are injected as in the anchor: a missing profile
list becomes one ``default`` profile over every filter, scorer and picker; a profile without a
picker gets ``max-score-picker``; a scorer without a weight gets 1.0; a plugin that consumes
data nobody produces gets that data's default producer. A ``candidate-sampler`` (at most one)
is listed under plugins only; the pipeline runs it before every producer it does not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epp.scheduling.framework import (
    CandidateSampler,
    DataKey,
    DataProducer,
    Filter,
    Picker,
    Plugin,
    PluginContext,
    Scorer,
)
from epp.scheduling.pipeline import Pipeline, SchedulingProfile, WeightedScorer
from epp.scheduling.registry import UnknownPluginType, default_producer_type, plugin_class

API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
DEFAULT_PICKER = "max-score-picker"


class ConfigError(ValueError):
    """The EndpointPickerConfig is invalid; the message says where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PluginSpec(_Strict):
    type: str
    name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def effective_name(self) -> str:
        return self.name or self.type


class ProfilePluginRef(_Strict):
    plugin_ref: str = Field(alias="pluginRef")
    weight: float | None = Field(default=None, ge=0)


class SchedulingProfileSpec(_Strict):
    name: str
    plugins: list[ProfilePluginRef]


class EndpointPickerConfig(_Strict):
    api_version: Literal[API_VERSIONS] = Field(default=API_VERSIONS[0], alias="apiVersion")  # type: ignore[valid-type]
    kind: Literal["EndpointPickerConfig"] = "EndpointPickerConfig"
    feature_gates: list[str] = Field(default_factory=list, alias="featureGates")
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[SchedulingProfileSpec] = Field(default_factory=list, alias="schedulingProfiles")
    flow_control: dict[str, Any] | None = Field(default=None, alias="flowControl")
    """Off (None) unless given; parsed by the package that owns it (``epp.flowcontrol.config``)."""

    @classmethod
    def from_yaml(cls, text: str) -> EndpointPickerConfig:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"EndpointPickerConfig is not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError("EndpointPickerConfig must be a YAML mapping")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid EndpointPickerConfig: {exc}") from exc

    @classmethod
    def from_file(cls, path: Path | str) -> EndpointPickerConfig:
        return cls.from_yaml(Path(path).read_text())


def instantiate(spec: PluginSpec, context: PluginContext) -> Plugin:
    try:
        cls = plugin_class(spec.type)
    except UnknownPluginType as exc:
        raise ConfigError(str(exc.args[0])) from None
    try:
        params = cls.Parameters.model_validate(spec.parameters)
    except ValidationError as exc:
        raise ConfigError(f"plugin {spec.effective_name!r} ({spec.type}): bad parameters: {exc}") from exc
    return cls(spec.effective_name, params, context)


def _order_producers(producers: list[DataProducer]) -> list[DataProducer]:
    """Topological order: a producer runs after the producers of the data it consumes (or reads
    if present)."""
    by_key: dict[DataKey[Any], DataProducer] = {}
    for producer in producers:
        for key in producer.produces:
            if key in by_key:
                raise ConfigError(
                    f"data {key.name!r} is produced by both {by_key[key].name!r} and {producer.name!r}"
                )
            by_key[key] = producer
    ordered: list[DataProducer] = []
    visiting: set[str] = set()

    def visit(producer: DataProducer) -> None:
        if producer in ordered:
            return
        if producer.name in visiting:
            raise ConfigError(f"producers form a cycle through {producer.name!r}")
        visiting.add(producer.name)
        for key in (*producer.consumes, *producer.reads_if_present):
            if key in by_key:
                visit(by_key[key])
        visiting.discard(producer.name)
        ordered.append(producer)

    for producer in producers:
        visit(producer)
    return ordered


def _add_missing_producers(plugins: dict[str, Plugin], context: PluginContext) -> None:
    """Create the default producer of every consumed key that no configured plugin produces."""
    while True:
        produced = {key for p in plugins.values() for key in p.produces}
        missing = [(key, p) for p in plugins.values() for key in p.consumes if key not in produced]
        if not missing:
            return
        key, consumer = missing[0]
        type_name = default_producer_type(key)
        if type_name is None:
            raise ConfigError(f"plugin {consumer.name!r} needs data {key.name!r}, which nothing produces")
        if type_name in plugins:
            raise ConfigError(f"plugin {type_name!r} exists but does not produce {key.name!r}")
        plugins[type_name] = instantiate(PluginSpec(type=type_name), context)


def _build_profile(
    spec: SchedulingProfileSpec, plugins: dict[str, Plugin], context: PluginContext
) -> SchedulingProfile:
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    for ref in spec.plugins:
        plugin = plugins.get(ref.plugin_ref)
        if plugin is None:
            raise ConfigError(f"profile {spec.name!r} references unknown plugin {ref.plugin_ref!r}")
        if isinstance(plugin, Scorer):
            scorers.append(WeightedScorer(plugin, 1.0 if ref.weight is None else ref.weight))
        elif ref.weight is not None:
            raise ConfigError(
                f"profile {spec.name!r}: weight given for {ref.plugin_ref!r}, which is no scorer"
            )
        if isinstance(plugin, Filter):
            filters.append(plugin)
        if isinstance(plugin, Picker):
            pickers.append(plugin)
        if not isinstance(plugin, Filter | Scorer | Picker):
            raise ConfigError(
                f"profile {spec.name!r}: {ref.plugin_ref!r} is not a filter, scorer or picker "
                "(producers and hooks are listed under plugins only)"
            )
    if len(pickers) > 1:
        raise ConfigError(f"profile {spec.name!r} has {len(pickers)} pickers; at most one is allowed")
    if not pickers:
        picker = plugins.get(DEFAULT_PICKER) or instantiate(PluginSpec(type=DEFAULT_PICKER), context)
        plugins.setdefault(DEFAULT_PICKER, picker)
        pickers.append(picker)  # type: ignore[arg-type]
    return SchedulingProfile(spec.name, filters, scorers, pickers[0])


def _default_profile_spec(plugins: dict[str, Plugin]) -> SchedulingProfileSpec:
    refs = [
        ProfilePluginRef(pluginRef=name)
        for name, p in plugins.items()
        if isinstance(p, Filter | Scorer | Picker)
    ]
    return SchedulingProfileSpec(name="default", plugins=refs)


def build_pipeline(config: EndpointPickerConfig, context: PluginContext) -> Pipeline:
    """Instantiate and wire every plugin; raise :class:`ConfigError` on any inconsistency."""
    plugins: dict[str, Plugin] = {}
    for spec in config.plugins:
        if spec.effective_name in plugins:
            raise ConfigError(f"two plugins are named {spec.effective_name!r}; give one a 'name'")
        plugins[spec.effective_name] = instantiate(spec, context)
    profile_specs = config.scheduling_profiles or [_default_profile_spec(plugins)]
    if len(profile_specs) != 1:
        raise ConfigError(
            f"{len(profile_specs)} scheduling profiles given; this EPP runs exactly one per request"
        )
    profile = _build_profile(profile_specs[0], plugins, context)
    _add_missing_producers(plugins, context)
    producers = _order_producers([p for p in plugins.values() if isinstance(p, DataProducer)])
    samplers = [p for p in plugins.values() if isinstance(p, CandidateSampler)]
    if len(samplers) > 1:
        raise ConfigError(f"{len(samplers)} candidate samplers configured; at most one is allowed")
    if not samplers:
        return Pipeline(plugins=dict(plugins), producers=producers, profile=profile)
    inputs = _inputs_of(samplers[0], producers)
    return Pipeline(
        plugins=dict(plugins),
        producers=[p for p in producers if p not in inputs],
        profile=profile,
        sampler=samplers[0],
        sampling_inputs=inputs,
    )


def _inputs_of(sampler: CandidateSampler, ordered: list[DataProducer]) -> list[DataProducer]:
    """The producers ``sampler`` reads from, and theirs in turn, in ``ordered``'s order."""
    by_key = {key: p for p in ordered for key in p.produces}
    needed: set[str] = set()
    keys = [*sampler.consumes, *sampler.reads_if_present]
    while keys:
        producer = by_key.get(keys.pop())
        if producer is not None and producer.name not in needed:
            needed.add(producer.name)
            keys.extend((*producer.consumes, *producer.reads_if_present))
    return [p for p in ordered if p.name in needed]
