from __future__ import annotations

import pytest

from epp.configs import config_path
from epp.plugins.prefix_cache import ApproximatePrefixCacheProducer
from epp.scheduling.config import ConfigError, EndpointPickerConfig, build_pipeline
from epp.scheduling.framework import PluginContext


def build(text: str, context: PluginContext):
    return build_pipeline(EndpointPickerConfig.from_yaml(text), context)


def test_shipped_default_is_the_anchor_profile(context: PluginContext) -> None:
    pipeline = build_pipeline(EndpointPickerConfig.from_file(config_path("gie-default")), context)
    weights = {ws.scorer.type_name: ws.weight for ws in pipeline.profile.scorers}
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
    assert pipeline.profile.picker.type_name == "max-score-picker"
    assert [p.type_name for p in pipeline.producers] == ["approximate-prefix-cache-producer"]


def test_consumer_without_producer_gets_the_default_producer(context: PluginContext) -> None:
    pipeline = build("plugins: [{type: prefix-cache-scorer}]", context)
    assert isinstance(pipeline.producers[0], ApproximatePrefixCacheProducer)
    assert pipeline.pre_request == [pipeline.producers[0]]
    # No profile given: one default profile over every scorer, with the default picker.
    assert pipeline.profile.name == "default"
    assert pipeline.profile.picker.type_name == "max-score-picker"
    assert pipeline.profile.scorers[0].weight == 1.0


def test_a_producer_runs_after_the_data_it_reads_if_present_without_asking_for_it(
    context: PluginContext,
) -> None:
    # The token-load producer reads the prefix match when one is produced (to release peer turns
    # that a prompt continues), so it runs after its producer, wherever the config lists it...
    listed_first = "plugins: [{type: token-load-producer}, {type: approximate-prefix-cache-producer}]"
    assert [p.type_name for p in build(listed_first, context).producers] == [
        "approximate-prefix-cache-producer",
        "token-load-producer",
    ]
    # ...but unlike a consumed key, it does not add a default producer for it.
    alone = build("plugins: [{type: token-load-producer}]", context)
    assert [p.type_name for p in alone.producers] == ["token-load-producer"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("plugins: [{type: no-such-plugin}]", "unknown plugin type 'no-such-plugin'"),
        ("plugins: [{type: queue-scorer, parameters: {bogus: 1}}]", "bad parameters"),
        (
            "plugins: [{type: approximate-prefix-cache-producer, parameters: {blockSizeTokens: 3}}]",
            "bad parameters",
        ),
        ("plugins: [{type: queue-scorer}, {type: queue-scorer}]", "two plugins are named 'queue-scorer'"),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: p, plugins: [{pluginRef: nope}]}]",
            "unknown plugin 'nope'",
        ),
        (
            "plugins: [{type: max-score-picker}]\nschedulingProfiles: [{name: p, plugins: "
            "[{pluginRef: max-score-picker, weight: 2}]}]",
            "no scorer",
        ),
        (
            "plugins: [{type: max-score-picker}, {type: random-picker}]\n"
            "schedulingProfiles: [{name: p, plugins: [{pluginRef: max-score-picker},"
            " {pluginRef: random-picker}]}]",
            "2 pickers",
        ),
        (
            "plugins: [{type: approximate-prefix-cache-producer}]\nschedulingProfiles: [{name: p, plugins: "
            "[{pluginRef: approximate-prefix-cache-producer}]}]",
            "not a filter, scorer or picker",
        ),
        ("kind: Other", "invalid EndpointPickerConfig"),
        ("plugins: [{type: queue-scorer, extra: 1}]", "invalid EndpointPickerConfig"),
        ("- just a list", "must be a YAML mapping"),
        ("plugins: [", "not valid YAML"),
    ],
)
def test_bad_configs_fail_at_start_up_naming_the_problem(
    text: str, message: str, context: PluginContext
) -> None:
    with pytest.raises(ConfigError, match=message):
        build(text, context)
