"""The stratified sliding window of training samples, one per model.

Samples are sorted into buckets by the regime they were taken in: queue length
{0, 1–2, 3–5, 6–10, 11+} × KV-cache usage in 5% steps × prefix-cache score quartile
(400 buckets, as the llm-d training server does), and apart for each endpoint class (the
``endpoint_class`` field; llm-d's pools are of one class). Each stratum, a bucket of one
class, keeps its newest ``bucket_capacity`` samples, so a flood of samples from a common regime
or a common class evicts only its own old samples: rare regimes (a long queue, a full KV cache)
and the few endpoints of a rare class are not forgotten.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from trainer.features import FEATURE_COLUMNS

log = logging.getLogger(__name__)

QUEUE_EDGES = np.array([1, 3, 6, 11])
"""Lower bounds of the queue buckets after the first: 0 | 1–2 | 3–5 | 6–10 | 11+."""
QUEUE_LABELS = ("0", "1-2", "3-5", "6-10", "11+")
KV_STEPS = 20
PREFIX_STEPS = 4
NUM_BUCKETS = len(QUEUE_LABELS) * KV_STEPS * PREFIX_STEPS

_WAITING = FEATURE_COLUMNS.index("num_request_waiting")
_KV = FEATURE_COLUMNS.index("kv_cache_percentage")
_PREFIX = FEATURE_COLUMNS.index("prefix_cache_score")
_CLASS = FEATURE_COLUMNS.index("endpoint_class")


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


MAX_ENDPOINT_CLASSES = 64
"""Classes a window holds samples of; later ones' samples are refused. A pool has a handful
(accelerator types × serving configs), and each class may hold 400 buckets' worth of samples, so
the bound is what keeps the window's memory bounded whatever codes arrive."""


def stratum_of(features: np.ndarray) -> np.ndarray:
    """Stratum of each row: its endpoint class's own set of regime buckets (``bucket_of``)."""
    return features[:, _CLASS].astype(np.int64) * NUM_BUCKETS + bucket_of(features)


class _Ring:
    """One stratum's newest samples, at most ``capacity``, in a ring buffer."""

    __slots__ = ("features", "filled", "next", "targets")

    def __init__(self, capacity: int, n_features: int) -> None:
        self.features = np.empty((capacity, n_features), np.float32)
        self.targets = np.empty(capacity, np.float64)
        self.filled = 0
        self.next = 0

    def append(self, features: np.ndarray, targets: np.ndarray) -> None:
        capacity = len(self.targets)
        if len(features) > capacity:
            features, targets = features[-capacity:], targets[-capacity:]
        count = len(features)
        slots = (self.next + np.arange(count)) % capacity
        self.features[slots] = features
        self.targets[slots] = targets
        self.next = (self.next + count) % capacity
        self.filled = min(self.filled + count, capacity)


class StratifiedWindow:
    """Bounded per-stratum FIFO of (feature row, target) pairs.

    A stratum is a regime bucket of one endpoint class, so a class with few endpoints keeps its
    samples however many the others send. Each stratum's ring buffer is allocated on its first
    sample. Not thread-safe: mutate it from one thread (the server's event loop) and hand
    :meth:`snapshot` copies to trainers.
    """

    def __init__(self, n_features: int, bucket_capacity: int) -> None:
        if bucket_capacity < 1:
            raise ValueError("bucket_capacity must be at least 1")
        self.n_features = n_features
        self.bucket_capacity = bucket_capacity
        self._rings: dict[int, _Ring] = {}
        self._classes: set[int] = set()
        self.added_total = 0
        """Samples ever added (evicted ones included): changes whenever the window does."""
        self.refused_total = 0
        """Samples refused because their class came after ``MAX_ENDPOINT_CLASSES`` others."""

    def __len__(self) -> int:
        return sum(ring.filled for ring in self._rings.values())

    def bucket_counts(self) -> np.ndarray:
        """Samples held in each stratum that holds any."""
        return np.array([ring.filled for ring in self._rings.values()], dtype=np.int64)

    def add(self, features: np.ndarray, targets: np.ndarray) -> None:
        """Add samples in arrival order; each stratum evicts its oldest beyond its capacity."""
        if features.ndim != 2 or features.shape[1] != self.n_features or len(targets) != len(features):
            raise ValueError(f"expected an (n, {self.n_features}) matrix and n targets")
        strata = stratum_of(features)
        features, targets, strata = self._admitted(features, targets, strata)
        if len(features) == 0:
            return
        order = np.argsort(strata, kind="stable")  # stable: arrival order within a stratum
        sorted_strata = strata[order]
        starts = np.flatnonzero(np.r_[True, sorted_strata[1:] != sorted_strata[:-1]])
        ends = np.r_[starts[1:], len(order)]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            rows = order[start:end]
            stratum = int(sorted_strata[start])
            ring = self._rings.get(stratum)
            if ring is None:
                ring = self._rings[stratum] = _Ring(self.bucket_capacity, self.n_features)
            ring.append(features[rows], targets[rows])
        self.added_total += len(features)

    def _admitted(
        self, features: np.ndarray, targets: np.ndarray, strata: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The samples whose class the window holds or has room for (new classes in code order)."""
        classes = strata // NUM_BUCKETS
        new = sorted(set(np.unique(classes).tolist()) - self._classes)
        room = max(MAX_ENDPOINT_CLASSES - len(self._classes), 0)
        self._classes.update(new[:room])
        refused = new[room:]
        if not refused:
            return features, targets, strata
        keep = ~np.isin(classes, refused)
        if self.refused_total == 0:
            log.warning(
                "more than %d endpoint classes: samples of classes %s refused", MAX_ENDPOINT_CLASSES, refused
            )
        self.refused_total += int((~keep).sum())
        return features[keep], targets[keep], strata[keep]

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of every held sample: the feature matrix and the targets (stratum by stratum)."""
        held = [ring for _, ring in sorted(self._rings.items())]
        if not held:
            return np.empty((0, self.n_features), np.float32), np.empty(0, np.float64)
        features = np.concatenate([ring.features[: ring.filled] for ring in held])
        targets = np.concatenate([ring.targets[: ring.filled] for ring in held])
        return features, targets

    def status(self) -> dict[str, Any]:
        """Sample counts, in total and for every non-empty stratum."""
        strata = sorted(self._rings.items())
        return {
            "samples": len(self),
            "added_total": self.added_total,
            "bucket_capacity": self.bucket_capacity,
            "buckets_used": len(strata),
            "buckets_per_class": NUM_BUCKETS,
            "endpoint_classes": len(self._classes),
            "refused_samples": self.refused_total,
            "buckets": [
                {
                    "endpoint_class": stratum // NUM_BUCKETS,
                    **bucket_label(stratum % NUM_BUCKETS),
                    "count": ring.filled,
                }
                for stratum, ring in strata
            ],
        }
