"""The PromQL helpers the Prometheus integration test relies on."""

from __future__ import annotations

from tests.observability.prometheus import as_signal, metric_names


def test_metric_names_are_the_selected_series_not_functions_labels_or_keywords() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, model_name) "
        '(rate(inference_objective_request_ttft_seconds_bucket{model_name!="x", le=~"0.5"}[5m]))) '
        "/ on (model_name) group_left max without (pod) "
        "(vllm:prefix_cache_hits_total offset 1m) > bool 0 and changes(trainer_model_version[15m]) == 0"
    )
    assert metric_names(expr) == {
        "inference_objective_request_ttft_seconds_bucket",
        "vllm:prefix_cache_hits_total",
        "trainer_model_version",
    }


def test_metric_names_of_a_sum_of_two_gauges() -> None:
    assert metric_names("max by (model_server_pod) (a_tokens + b_tokens)") == {"a_tokens", "b_tokens"}


def test_as_signal_turns_threshold_comparisons_into_bool_ones() -> None:
    assert as_signal("x / y > 0.1") == "x / y > bool 0.1"
    assert (
        as_signal("changes(v[15m]) == 0\n and rate(s[15m]) > 0")
        == "changes(v[15m]) == bool 0\n and rate(s[15m]) > bool 0"
    )
    assert as_signal('up{job!="a"} >= -1') == 'up{job!="a"} >= bool -1'
