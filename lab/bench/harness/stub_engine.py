"""A stand-in model server made of Envoy direct responses, for measuring router overhead only.

Each listener answers ``/metrics`` with a vLLM scrape (a minimal one unless given another),
``/v1/models`` with a model listing and any other path with a fixed one-token completion, at
C++ speed, so that what a benchmark measures is the proxy and the EPP rather than the model
server.
"""

from __future__ import annotations

import json
from typing import Any

from sim.openai_api import models_response

METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0\n'
)
COMPLETION = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 1,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
)
MODELS = json.dumps(models_response("tiny", "tiny", 4096, created=1))
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _listener(port: int, metrics: str) -> dict[str, Any]:
    def reply(prefix: str, body: str, content_type: str) -> dict[str, Any]:
        return {
            "match": {"prefix": prefix},
            "direct_response": {"status": 200, "body": {"inline_string": body}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type}}],
        }

    hcm = {
        "@type": _HCM,
        "stat_prefix": f"stub{port}",
        "route_config": {
            "max_direct_response_body_size_bytes": max(4096, len(metrics.encode())),
            "virtual_hosts": [
                {
                    "name": "stub",
                    "domains": ["*"],
                    "routes": [
                        reply("/metrics", metrics, "text/plain"),
                        reply("/v1/models", MODELS, "application/json"),
                        reply("/", COMPLETION, "application/json"),
                    ],
                }
            ],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": f"stub-{port}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def stub_engine_bootstrap(ports: list[int], metrics: str = METRICS) -> dict[str, Any]:
    """Envoy's bootstrap for one stub engine per port, each answering ``metrics`` on ``/metrics``."""
    return {
        "static_resources": {"listeners": [_listener(p, metrics) for p in ports]},
    }
