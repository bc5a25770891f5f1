"""The stratified window: which bucket a sample lands in, per-bucket bounds and eviction, and
each endpoint class's buckets apart."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.features import FEATURE_COLUMNS
from trainer.window import (
    KV_STEPS,
    MAX_ENDPOINT_CLASSES,
    NUM_BUCKETS,
    PREFIX_STEPS,
    StratifiedWindow,
    bucket_label,
    bucket_of,
)
from wire.latency import MAX_ENDPOINT_CLASS, endpoint_class_code

WAITING = FEATURE_COLUMNS.index("num_request_waiting")
KV = FEATURE_COLUMNS.index("kv_cache_percentage")
PREFIX = FEATURE_COLUMNS.index("prefix_cache_score")
LENGTH = FEATURE_COLUMNS.index("input_token_length")
CLASS = FEATURE_COLUMNS.index("endpoint_class")


def rows(
    waiting: float, kv: float, prefix: float, count: int = 1, first_id: int = 0, endpoint_class: int = 0
) -> np.ndarray:
    """``count`` feature rows in one regime; ``input_token_length`` numbers them."""
    matrix = np.zeros((count, len(FEATURE_COLUMNS)), np.float32)
    matrix[:, WAITING], matrix[:, KV], matrix[:, PREFIX] = waiting, kv, prefix
    matrix[:, LENGTH] = np.arange(first_id, first_id + count)
    matrix[:, CLASS] = endpoint_class
    return matrix


def test_there_are_400_buckets() -> None:
    assert NUM_BUCKETS == 5 * 20 * 4


@pytest.mark.parametrize(
    ("waiting", "queue"),
    [
        (0, "0"),
        (1, "1-2"),
        (2, "1-2"),
        (3, "3-5"),
        (5, "3-5"),
        (6, "6-10"),
        (10, "6-10"),
        (11, "11+"),
        (500, "11+"),
    ],
)
def test_queue_buckets(waiting: int, queue: str) -> None:
    assert bucket_label(int(bucket_of(rows(waiting, 0.0, 0.0))[0]))["queue"] == queue


@pytest.mark.parametrize(
    ("kv", "label"),
    [(0.0, "0-5"), (0.049, "0-5"), (0.051, "5-10"), (0.5, "50-55"), (0.99, "95-100"), (1.0, "95-100")],
)
def test_kv_buckets_are_5_percent_steps(kv: float, label: str) -> None:
    assert bucket_label(int(bucket_of(rows(0, kv, 0.0))[0]))["kv_percent"] == label


@pytest.mark.parametrize(
    ("prefix", "quartile"), [(0.0, "q1"), (0.24, "q1"), (0.26, "q2"), (0.6, "q3"), (1.0, "q4")]
)
def test_prefix_quartiles(prefix: float, quartile: str) -> None:
    assert bucket_label(int(bucket_of(rows(0, 0.0, prefix))[0]))["prefix_quartile"] == quartile


def test_every_bucket_is_reachable_and_distinct() -> None:
    grid = np.concatenate(
        [
            rows(w, (k + 0.5) / KV_STEPS, (p + 0.5) / PREFIX_STEPS)
            for w in (0, 1, 4, 8, 20)
            for k in range(KV_STEPS)
            for p in range(PREFIX_STEPS)
        ]
    )
    assert sorted(bucket_of(grid).tolist()) == list(range(NUM_BUCKETS))


def test_each_bucket_is_bounded_and_evicts_its_own_oldest() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=3)
    window.add(rows(0, 0.1, 0.1, count=5, first_id=0), np.arange(5.0))  # common regime, over capacity
    window.add(rows(20, 0.97, 0.9, count=1, first_id=100), np.array([100.0]))  # rare regime
    window.add(rows(0, 0.1, 0.1, count=2, first_id=5), np.array([5.0, 6.0]))  # more of the common one
    features, targets = window.snapshot()
    assert len(window) == 4
    kept = sorted(features[:, LENGTH].astype(int).tolist())
    assert kept == [4, 5, 6, 100]  # the common bucket kept its newest 3; the rare sample survived
    assert sorted(targets.tolist()) == [4.0, 5.0, 6.0, 100.0]
    assert sorted(window.bucket_counts()[window.bucket_counts() > 0].tolist()) == [1, 3]


def test_one_batch_larger_than_a_bucket_keeps_its_newest() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=4)
    window.add(rows(3, 0.3, 0.3, count=10), np.arange(10.0))
    _, targets = window.snapshot()
    assert sorted(targets.tolist()) == [6.0, 7.0, 8.0, 9.0]
    window.add(rows(3, 0.3, 0.3, count=1, first_id=10), np.array([10.0]))
    _, targets = window.snapshot()
    assert sorted(targets.tolist()) == [7.0, 8.0, 9.0, 10.0]


def test_arrival_order_is_kept_within_a_bucket_across_a_mixed_batch() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=2)
    mixed = np.concatenate(
        [rows(0, 0.1, 0.1, first_id=i) if i % 2 else rows(9, 0.8, 0.8, first_id=i) for i in range(8)]
    )
    window.add(mixed, np.arange(8.0))
    _, targets = window.snapshot()
    assert sorted(targets.tolist()) == [4.0, 5.0, 6.0, 7.0]


def test_snapshot_is_a_copy() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=5)
    window.add(rows(0, 0.5, 0.5, count=3), np.ones(3))
    features, targets = window.snapshot()
    features[:] = -1
    targets[:] = -1
    again_features, again_targets = window.snapshot()
    assert (again_features[:, WAITING] == 0).all()
    assert (again_targets == 1).all()


def test_empty_window() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=5)
    features, targets = window.snapshot()
    assert features.shape == (0, len(FEATURE_COLUMNS))
    assert len(targets) == 0
    assert window.status()["samples"] == 0


def test_status_lists_nonempty_buckets() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=5)
    window.add(rows(1, 0.12, 0.8, count=2), np.ones(2))
    status = window.status()
    assert status["samples"] == 2
    assert status["added_total"] == 2
    assert status["buckets"] == [
        {"endpoint_class": 0, "queue": "1-2", "kv_percent": "10-15", "prefix_quartile": "q4", "count": 2}
    ]
    assert status["endpoint_classes"] == 1


def test_a_rare_class_keeps_its_samples_through_a_flood_from_a_common_one() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=3)
    rare = endpoint_class_code("nvidia-l4")
    window.add(rows(0, 0.1, 0.1, count=2, first_id=100, endpoint_class=rare), np.array([100.0, 101.0]))
    common = endpoint_class_code("nvidia-h100-80gb")
    window.add(rows(0, 0.1, 0.1, count=50, endpoint_class=common), np.arange(50.0))  # the same regime
    features, targets = window.snapshot()
    assert sorted(targets.tolist()) == [47.0, 48.0, 49.0, 100.0, 101.0]
    assert sorted(features[:, CLASS].tolist()) == sorted([float(common)] * 3 + [float(rare)] * 2)
    status = window.status()
    assert status["endpoint_classes"] == 2
    assert sorted((b["endpoint_class"], b["count"]) for b in status["buckets"]) == sorted(
        [(common, 3), (rare, 2)]
    )


def test_class_codes_are_stable_nonzero_and_exact_in_float32() -> None:
    assert endpoint_class_code("") == 0
    codes = {endpoint_class_code(f"class-{i}") for i in range(1000)}
    assert len(codes) == 1000 and 0 not in codes
    assert all(code <= MAX_ENDPOINT_CLASS and float(np.float32(code)) == code for code in codes)
    # Pinned: EPP replicas of different releases and the trainer's window must agree on it.
    assert endpoint_class_code("nvidia-h100-80gb") == 9865865


def test_add_refuses_mismatched_shapes() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=5)
    with pytest.raises(ValueError):
        window.add(np.zeros((2, 3), np.float32), np.ones(2))
    with pytest.raises(ValueError):
        window.add(rows(0, 0, 0, count=2), np.ones(3))


def test_classes_beyond_the_bound_are_refused_and_counted() -> None:
    window = StratifiedWindow(len(FEATURE_COLUMNS), bucket_capacity=2)
    held = np.concatenate([rows(0, 0.1, 0.1, endpoint_class=c) for c in range(1, MAX_ENDPOINT_CLASSES + 1)])
    window.add(held, np.ones(MAX_ENDPOINT_CLASSES))
    late = MAX_ENDPOINT_CLASSES + 1
    window.add(rows(0, 0.1, 0.1, count=3, endpoint_class=late), np.full(3, 9.0))
    window.add(rows(0, 0.1, 0.1, count=2, endpoint_class=1, first_id=50), np.full(2, 5.0))  # a held class
    features, targets = window.snapshot()
    assert late not in features[:, CLASS].tolist() and 9.0 not in targets.tolist()
    assert targets.tolist().count(5.0) == 2
    status = window.status()
    assert (status["endpoint_classes"], status["refused_samples"]) == (MAX_ENDPOINT_CLASSES, 3)
    assert window.added_total == MAX_ENDPOINT_CLASSES + 2
