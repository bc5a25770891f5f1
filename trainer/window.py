"""The stratified sliding window of training samples, one per model.

Samples are sorted into buckets by the regime they were taken in: queue length
{0, 1–2, 3–5, 6–10, 11+} × KV-cache usage in 5% steps × prefix-cache score quartile
(400 buckets, as the llm-d training server does). Each bucket keeps its newest
``bucket_capacity`` samples, so a flood of samples from a common regime evicts only that
regime's old samples: rare regimes (a long queue, a full KV cache) are not forgotten.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.features import FEATURE_COLUMNS

QUEUE_EDGES = np.array([1, 3, 6, 11])
"""Lower bounds of the queue buckets after the first: 0 | 1–2 | 3–5 | 6–10 | 11+."""
QUEUE_LABELS = ("0", "1-2", "3-5", "6-10", "11+")
KV_STEPS = 20
PREFIX_STEPS = 4
NUM_BUCKETS = len(QUEUE_LABELS) * KV_STEPS * PREFIX_STEPS

_WAITING = FEATURE_COLUMNS.index("num_request_waiting")
_KV = FEATURE_COLUMNS.index("kv_cache_percentage")
_PREFIX = FEATURE_COLUMNS.index("prefix_cache_score")


def bucket_of(features: np.ndarray) -> np.ndarray:
    """Bucket index of each row of a feature matrix (``FEATURE_COLUMNS`` order)."""
    queue = np.searchsorted(QUEUE_EDGES, features[:, _WAITING], side="right")
    # float32 rounding may put 0.05 a hair below the edge; the bucket edges are not exact anyway.
    kv = np.minimum((features[:, _KV] * KV_STEPS).astype(np.int64), KV_STEPS - 1)
    prefix = np.minimum((features[:, _PREFIX] * PREFIX_STEPS).astype(np.int64), PREFIX_STEPS - 1)
    return (queue * KV_STEPS + kv) * PREFIX_STEPS + prefix


def bucket_label(bucket: int) -> dict[str, str]:
    rest, prefix = divmod(bucket, PREFIX_STEPS)
    queue, kv = divmod(rest, KV_STEPS)
    step = 100 // KV_STEPS
    return {
        "queue": QUEUE_LABELS[queue],
        "kv_percent": f"{kv * step}-{(kv + 1) * step}",
        "prefix_quartile": f"q{prefix + 1}",
    }


class StratifiedWindow:
    """Bounded per-bucket FIFO of (feature row, target) pairs.

    Each bucket is a ring buffer allocated on its first sample. Not thread-safe: mutate it from
    one thread (the server's event loop) and hand :meth:`snapshot` copies to trainers.
    """

    def __init__(self, n_features: int, bucket_capacity: int) -> None:
        if bucket_capacity < 1:
            raise ValueError("bucket_capacity must be at least 1")
        self.n_features = n_features
        self.bucket_capacity = bucket_capacity
        self._features: list[np.ndarray | None] = [None] * NUM_BUCKETS
        self._targets: list[np.ndarray | None] = [None] * NUM_BUCKETS
        self._filled = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self._next = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self.added_total = 0
        """Samples ever added (evicted ones included): changes whenever the window does."""

    def __len__(self) -> int:
        return int(self._filled.sum())

    def bucket_counts(self) -> np.ndarray:
        """Samples held in each bucket (a copy)."""
        return self._filled.copy()

    def add(self, features: np.ndarray, targets: np.ndarray) -> None:
        """Add samples in arrival order; each bucket evicts its oldest beyond its capacity."""
        if features.ndim != 2 or features.shape[1] != self.n_features or len(targets) != len(features):
            raise ValueError(f"expected an (n, {self.n_features}) matrix and n targets")
        if len(features) == 0:
            return
        buckets = bucket_of(features)
        order = np.argsort(buckets, kind="stable")  # stable: arrival order within a bucket
        sorted_buckets = buckets[order]
        starts = np.flatnonzero(np.r_[True, sorted_buckets[1:] != sorted_buckets[:-1]])
        ends = np.r_[starts[1:], len(order)]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            rows = order[start:end]
            self._append(int(sorted_buckets[start]), features[rows], targets[rows])
        self.added_total += len(features)

    def _append(self, bucket: int, features: np.ndarray, targets: np.ndarray) -> None:
        capacity = self.bucket_capacity
        ring_features, ring_targets = self._features[bucket], self._targets[bucket]
        if ring_features is None or ring_targets is None:
            ring_features = self._features[bucket] = np.empty((capacity, self.n_features), np.float32)
            ring_targets = self._targets[bucket] = np.empty(capacity, np.float64)
        if len(features) > capacity:
            features, targets = features[-capacity:], targets[-capacity:]
        count = len(features)
        slots = (self._next[bucket] + np.arange(count)) % capacity
        ring_features[slots] = features
        ring_targets[slots] = targets
        self._next[bucket] = (self._next[bucket] + count) % capacity
        self._filled[bucket] = min(self._filled[bucket] + count, capacity)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of every held sample: the feature matrix and the targets (bucket by bucket)."""
        held = np.flatnonzero(self._filled).tolist()
        if not held:
            return np.empty((0, self.n_features), np.float32), np.empty(0, np.float64)
        features = np.concatenate([self._features[b][: self._filled[b]] for b in held])  # type: ignore[index]
        targets = np.concatenate([self._targets[b][: self._filled[b]] for b in held])  # type: ignore[index]
        return features, targets

    def status(self) -> dict[str, Any]:
        """Sample counts, in total and for every non-empty bucket."""
        counts = self._filled
        return {
            "samples": int(counts.sum()),
            "added_total": self.added_total,
            "bucket_capacity": self.bucket_capacity,
            "buckets_used": int(np.count_nonzero(counts)),
            "buckets_total": NUM_BUCKETS,
            "buckets": [
                {**bucket_label(b), "count": int(counts[b])} for b in np.flatnonzero(counts).tolist()
            ],
        }
