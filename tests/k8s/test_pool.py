"""Translation of InferencePool / Pod / InferenceObjective objects (pure functions)."""

from __future__ import annotations

import pytest

from epp.k8s.pool import (
    PoolError,
    label_selector,
    objective_priorities,
    parse_pool,
    pod_endpoints,
    pool_endpoints,
)
from tests.k8s.shapes import inference_objective, inference_pool, pod


def test_pool_spec_fields() -> None:
    pool = parse_pool(inference_pool())
    assert pool.match_labels == {"app": "vllm-llama3-8b-instruct"}
    assert pool.ports == [8000]
    assert pool.endpointPickerRef is not None
    assert pool.endpointPickerRef.failureMode == "FailOpen"
    assert pool.endpointPickerRef.port is not None and pool.endpointPickerRef.port.number == 9002


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
        {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []},
        {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]},
    ],
)
def test_unusable_pool_is_an_error(spec: dict) -> None:
    obj = inference_pool()
    obj["spec"] = spec
    with pytest.raises(PoolError, match="vllm-llama3-8b-instruct"):
        parse_pool(obj)


def test_ready_matching_pod_is_one_endpoint() -> None:
    [endpoint] = pod_endpoints(pod("p-0", "10.52.3.17"), parse_pool(inference_pool()))
    assert (endpoint.name, endpoint.address, endpoint.port) == ("p-0", "10.52.3.17", 8000)
    assert endpoint.labels["app"] == "vllm-llama3-8b-instruct"


@pytest.mark.parametrize(
    "obj",
    [
        pod("p", "10.0.0.1", ready=False),
        pod("p", None),
        pod("p", "10.0.0.1", phase="Pending"),
        pod("p", "10.0.0.1", labels={"app": "other"}),
        pod("p", "not-an-ip"),
    ],
    ids=["not-ready", "no-ip", "pending", "other-labels", "bad-ip"],
)
def test_pods_that_do_not_count(obj: dict) -> None:
    assert pod_endpoints(obj, parse_pool(inference_pool())) == []


def test_terminating_pod_does_not_count() -> None:
    obj = pod("p", "10.0.0.1")
    obj["metadata"]["deletionTimestamp"] = "2026-01-10T10:00:00Z"
    assert pod_endpoints(obj, parse_pool(inference_pool())) == []


def test_data_parallel_ranks_are_one_endpoint_per_target_port() -> None:
    pool = parse_pool(inference_pool(ports=(8000, 8001)))
    endpoints = pool_endpoints(pool, [pod("b", "10.0.0.2"), pod("a", "fd00::1")])
    assert [(e.name, e.hostport) for e in endpoints] == [
        ("a-rank-0", "[fd00::1]:8000"),
        ("a-rank-1", "[fd00::1]:8001"),
        ("b-rank-0", "10.0.0.2:8000"),
        ("b-rank-1", "10.0.0.2:8001"),
    ]


def test_label_selector_is_sorted_equality_terms() -> None:
    assert label_selector({"b": "2", "a": "1"}) == "a=1,b=2"


def test_objective_priorities_for_this_pool_only() -> None:
    objectives = [
        inference_objective("batch", -1),
        inference_objective("chat", 10),
        inference_objective("default-priority", None),
        inference_objective("elsewhere", 5, pool="other-pool"),
    ]
    assert objective_priorities(objectives, "vllm-llama3-8b-instruct") == {
        "batch": -1,
        "chat": 10,
        "default-priority": 0,
    }
