"""The dashboard's panels and their PromQL, one definition for every dashboard we ship.

The Grafana and Cloud Monitoring generators render these, and the Prometheus integration test
runs every query against a scraped stack, so a panel cannot name a metric nobody exports.

Rates use a fixed 5-minute window (Cloud Monitoring has no ``$__rate_interval``). Per-endpoint
gauges take ``max`` over EPP replicas: with replica sync each replica reports the whole pool's
load, so a sum would count it once per replica. The prefix hit rate comes from the model
servers' own ``vllm:`` counters (the EPP does not see the engine's cache hits), so it needs
them scraped too.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = "5m"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str
    """Series name, with ``{{label}}`` placeholders (Grafana's legend format)."""


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    """A Grafana unit id: ``percentunit``, ``s``, ``reqps``, ``short``."""
    description: str
    queries: tuple[Query, ...]


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _rate(metric: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}[{WINDOW}]))"


def _share(numerator: str, denominator: str, by: str = "") -> str:
    return f"{_rate(numerator, by)} / {_rate(denominator, by)}"


def _quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {_rate(f'{histogram}_bucket', ', '.join(filter(None, ['le', by])))})"


def _mean(histogram: str, by: str = "") -> str:
    return _share(f"{histogram}_sum", f"{histogram}_count", by)


def _attainment(violations: str) -> str:
    return f"1 - ({_share(violations, 'inference_objective_request_total', 'model_name')})"


def _per_endpoint(metric: str) -> Query:
    return Query(f"max by (model_server_pod) ({metric})", "{{model_server_pod}}")


_TTFT = "inference_objective_request_ttft_seconds"
_PREDICTED_TTFT = "inference_objective_request_predicted_ttft_seconds"
_TPOT = "inference_objective_request_tpot_seconds"
_PREDICTED_TPOT = "inference_objective_request_predicted_tpot_seconds"
_TTFT_VIOLATIONS = "inference_objective_request_ttft_slo_violation_total"
_TPOT_VIOLATIONS = "inference_objective_request_tpot_slo_violation_total"


def _predicted_vs_actual(target: str, predicted: str, actual: str) -> Panel:
    """Mean and p90 of the ``predicted`` histogram against the ``actual`` one, in seconds."""
    return Panel(
        f"Predicted vs actual {target}",
        "s",
        f"Mean and p90 of the predicted {target} on the chosen endpoint against the measured {target}.",
        (
            Query(_mean(predicted), "predicted mean"),
            Query(_mean(actual), "actual mean"),
            Query(_quantile(0.9, predicted), "predicted p90"),
            Query(_quantile(0.9, actual), "actual p90"),
        ),
    )


SLO = Row(
    "SLOs",
    (
        Panel(
            "SLO attainment per objective",
            "percentunit",
            "Share of requests that met their x-slo-ttft-ms / x-slo-tpot-ms (requests without an "
            "SLO header count as met).",
            (
                Query(_attainment(_TTFT_VIOLATIONS), "TTFT {{model_name}}"),
                Query(_attainment(_TPOT_VIOLATIONS), "TPOT {{model_name}}"),
            ),
        ),
        Panel(
            "SLO violations per objective",
            "reqps",
            "Requests per second that missed their TTFT or TPOT objective.",
            (
                Query(_rate(_TTFT_VIOLATIONS, "model_name"), "TTFT {{model_name}}"),
                Query(_rate(_TPOT_VIOLATIONS, "model_name"), "TPOT {{model_name}}"),
            ),
        ),
        Panel(
            "Requests and errors",
            "reqps",
            "Requests received and requests that failed, by error code.",
            (
                Query(_rate("inference_objective_request_total", "model_name"), "{{model_name}}"),
                Query(_rate("inference_objective_request_error_total", "error_code"), "error {{error_code}}"),
            ),
        ),
    ),
)
PREDICTIONS = Row(
    "Predictions",
    (
        _predicted_vs_actual("TTFT", _PREDICTED_TTFT, _TTFT),
        _predicted_vs_actual("TPOT", _PREDICTED_TPOT, _TPOT),
        Panel(
            "Live prediction error",
            "percentunit",
            "Rolling MAPE and bias of the chosen endpoint's predictions per target and model "
            "version (bias > 0: predicted too slow), and whether the EPP routes on heuristics "
            "because the newest model drifted.",
            (
                Query(
                    "max by (target, model_version) (llm_epp_prediction_mape)",
                    "MAPE {{target}} v{{model_version}}",
                ),
                Query(
                    "max by (target, model_version) (llm_epp_prediction_bias)",
                    "bias {{target}} v{{model_version}}",
                ),
                Query("max (llm_epp_prediction_drifting)", "drifting"),
            ),
        ),
        Panel(
            "Prediction fallbacks by reason",
            "reqps",
            "Requests scheduled without predictions (the heuristic decided), by reason.",
            (Query(_rate("llm_epp_prediction_fallback_total", "reason"), "{{reason}}"),),
        ),
    ),
)
ENDPOINTS = Row(
    "Endpoints",
    (
        Panel(
            "Token load per endpoint",
            "short",
            "Uncached prompt tokens still to prefill plus the KV tokens of decoding requests, of the "
            "requests the EPP routed (what token-load scoring balances).",
            (
                _per_endpoint(
                    "llm_epp_endpoint_prefill_tokens_in_flight + llm_epp_endpoint_decode_tokens_in_flight"
                ),
            ),
        ),
        Panel(
            "Queue per endpoint",
            "short",
            "Requests waiting in each engine's queue, as last scraped.",
            (_per_endpoint("inference_pool_per_pod_queue_size"),),
        ),
        Panel(
            "KV-cache usage per endpoint",
            "percentunit",
            "Share of each engine's KV cache in use, as last scraped.",
            (_per_endpoint("inference_pool_per_pod_kv_cache_utilization"),),
        ),
        Panel(
            "Prefix-cache hit rate per endpoint",
            "percentunit",
            "Share of prompt tokens each engine found in its prefix cache (the engines' own counters).",
            (
                Query(
                    _share("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "instance"),
                    "{{instance}}",
                ),
            ),
        ),
        Panel(
            "Ready endpoints",
            "short",
            "Endpoints that are scheduling candidates.",
            (Query("min by (name) (inference_pool_ready_pods)", "{{name}}"),),
        ),
    ),
)
HEALTH = Row(
    "Scheduler, predictor and trainer",
    (
        Panel(
            "Scheduling latency",
            "s",
            "Time to pick an endpoint for a request (filters, scorers, predictions, picker).",
            (
                Query(_quantile(0.5, "inference_extension_scheduler_e2e_duration_seconds"), "p50"),
                Query(_quantile(0.99, "inference_extension_scheduler_e2e_duration_seconds"), "p99"),
            ),
        ),
        Panel(
            "Predictor latency",
            "s",
            "p99 of the EPP's coalesced calls to its predictors (network included) and of the "
            "predictors' own handling.",
            (
                Query(_quantile(0.99, "llm_epp_prediction_call_duration_seconds"), "EPP call p99"),
                Query(_quantile(0.99, "predictor_call_duration_seconds"), "predictor p99"),
            ),
        ),
        Panel(
            "Predictor calls by outcome",
            "reqps",
            "Calls the predictors answered (ok) or refused (invalid, unavailable: no model loaded).",
            (Query(_rate("predictor_calls_total", "outcome"), "{{outcome}}"),),
        ),
        Panel(
            "Model versions",
            "short",
            "Version the trainer last published and the version each predictor serves.",
            (
                Query("max (trainer_model_version)", "trainer"),
                Query("min (predictor_model_version)", "oldest predictor"),
            ),
        ),
        Panel(
            "Trainer holdout error",
            "percentunit",
            "Holdout MAPE of the current mean models, per target, and the holdout loss of each kept version.",
            (
                Query("max by (model) (trainer_model_mape)", "{{model}}"),
                Query(
                    "max by (model, version) (trainer_model_version_holdout_error)",
                    "{{model}} v{{version}}",
                ),
            ),
        ),
        Panel(
            "Training samples",
            "short",
            "Samples per second the EPP sent to the trainer (or dropped), and the trainer accepted.",
            (
                Query(_rate("llm_epp_training_rows_total", "outcome"), "EPP {{outcome}}"),
                Query(_rate("trainer_samples_total", "destination"), "trainer {{destination}}"),
            ),
        ),
        Panel(
            "Replica sync",
            "short",
            "With active-active EPP replicas: whether every replica is connected to NATS, and the "
            "fewest peers any replica hears.",
            (
                Query("min (llm_epp_sync_connected)", "connected (all replicas)"),
                Query("min (llm_epp_sync_peers_alive)", "peers alive (fewest)"),
            ),
        ),
    ),
)
ROWS: tuple[Row, ...] = (SLO, PREDICTIONS, ENDPOINTS, HEALTH)


def all_queries() -> list[Query]:
    """Every query of every panel, in dashboard order."""
    return [query for row in ROWS for panel in row.panels for query in panel.queries]
