"""``--tokenize-every N``: the model's tokenizer on one prompt in N, estimated counts calibrated
on those for the rest.

Tokenizing is the largest single part of a request's EPP CPU (~0.4-0.55 ms for a unique
1k-token prompt, ``docs/capacity.md``), and the library's own work: no cache helps a prompt
that shares nothing. Routing needs the ids for two things, prefix affinity and counts
(features, token load). Estimated ids (``epp.tokenizer.estimated``) keep prefix affinity; their
count is right only if the text's bytes per token is the estimate's. So every Nth prompt is
also tokenized by the served model's tokenizer, and the estimate runs at the ratio those
prompts measure: the counts are on the model's scale for this traffic (prose, code, other
scripts), and each prompt's error is its own text's departure from the traffic's mean.

A sampled prompt is tokenized over its tail (``SAMPLE_CHARS``), so that a long conversation's
turn costs no more to sample than a short prompt. The ratio moves only when a window of sampled
prompts measures one more than ``tolerance`` away from it, since a new ratio gives new ids: the
prefix index's entries of the old one stop matching, and prefix affinity starts over once.

Synced replicas (``epp.sync``) share prefix blocks, which are hashed from the ids, so they
must route on one ratio: each announces its own in its heartbeat once it has one (after a window,
or taken from a peer), and each routes on the ratio of the first replica by name that announces
one (``ReplicaSyncState.agreed_bytes_per_token``). That replica alone moves it by its windows;
when it leaves, the next has the same ratio already.

What is lost against tokenizing every prompt: precise (KV-event) prefix matching, which needs
the engine's ids (the EPP refuses the combination at start), and refusing prompts longer than
the context at the EPP (the engine refuses them, with the same error).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from epp.tokenizer.cache import TokenizerCache, check_inline
from epp.tokenizer.estimated import BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN, estimated_ids, utf8
from epp.tokenizer.model import PromptTokenizer

SAMPLE_CHARS = 8_192
"""A sampled prompt is tokenized over its last this many characters: the newest text, whose
bytes per token are the traffic's, at a bounded cost however long the conversation has grown."""


@dataclass
class CountCalibration:
    """The bytes per token the estimate uses, measured in windows of ``window`` sampled prompts."""

    window: int = 64
    tolerance: float = 0.1
    bytes_per_token: float = BYTES_PER_TOKEN
    last_error: float | None = None
    """The last window's mean relative error of the estimated counts (at the ratio then in use)."""
    changes: int = 0
    settled: bool = False
    """Whether the ratio is measured (a window has ended) or taken from a peer: one to announce."""
    following: bool = False
    """Whether the ratio is a peer's (``follow``): the windows then measure but do not move it."""
    _bytes: int = 0
    _tokens: int = 0
    _errors: list[float] = field(default_factory=list)

    def observe(self, size: int, tokens: int) -> None:
        """One sampled prompt: ``size`` bytes that the model's tokenizer made ``tokens`` tokens."""
        if tokens == 0:
            return
        estimate = math.ceil(size / self.bytes_per_token)
        self._errors.append(abs(estimate - tokens) / tokens)
        self._bytes += size
        self._tokens += tokens
        if len(self._errors) < self.window:
            return
        measured = min(max(self._bytes / self._tokens, 1.0), MAX_BYTES_PER_TOKEN)
        if not self.following and abs(measured / self.bytes_per_token - 1) > self.tolerance:
            self._move(measured)
        self.settled = True
        self.last_error = sum(self._errors) / len(self._errors)
        self._bytes, self._tokens, self._errors = 0, 0, []

    def follow(self, ratio: float | None) -> None:
        """Route on a peer's ``ratio`` (None: on our own from now on, starting from the current)."""
        self.following = ratio is not None
        if ratio is not None:
            self.settled = True
            if ratio != self.bytes_per_token:
                self._move(ratio)

    @property
    def announced(self) -> float | None:
        """The ratio to announce to peers: the one in use, once settled."""
        return self.bytes_per_token if self.settled else None

    def _move(self, ratio: float) -> None:
        self.bytes_per_token = ratio
        self.changes += 1


class SampledTokenizer:
    """Implements ``epp.tokenizer.model.PromptTokenizer``: estimated ids at the calibrated ratio,
    the model's tokenizer run on one prompt in ``every`` to calibrate it (see the module)."""

    exact = False
    cache: TokenizerCache | None = None

    def __init__(
        self,
        model: PromptTokenizer,
        every: int,
        calibration: CountCalibration | None = None,
        agreed: Callable[[], float | None] = lambda: None,
    ) -> None:
        """``agreed``: the ratio the synced replicas route on when a peer sets it, else None;
        looked up on the first prompt and then on each sampled one."""
        if every < 2:
            raise ValueError(f"a sampled tokenizer tokenizes one prompt in 2 or more, not {every}")
        self.model, self.every, self.agreed = model, every, agreed
        self.calibration = calibration or CountCalibration()
        self.sampled = 0
        self._seen = 0
        # Long prompts are encoded in a worker thread (epp.tokenizer.model.GIL_FREE_CHARS).
        self._lock = threading.Lock()

    @property
    def max_chars_per_token(self) -> int:
        """A run of the estimate's bytes holds at most that many characters."""
        return math.ceil(self.calibration.bytes_per_token)

    def encode(self, text: str, max_chars: int | None = None) -> list[int]:
        """The estimated ids of ``text``; ``TooLongToInline`` past ``max_chars`` characters."""
        check_inline(len(text), max_chars)
        data = utf8(text)
        with self._lock:
            self._seen += 1
            due = self._seen % self.every == 0
            if due or self._seen == 1:  # the peers' ratio looked up as often as we sample
                self.calibration.follow(self.agreed())
            ratio = self.calibration.bytes_per_token
        if due:
            tail = text[-SAMPLE_CHARS:]
            tokens = len(self.model.encode(tail))
            with self._lock:
                self.sampled += 1
                self.calibration.observe(len(utf8(tail)), tokens)
        return estimated_ids(data, ratio)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The model's own chat template: the text the engine will tokenize."""
        return self.model.render_chat(messages, add_generation_prompt)


@runtime_checkable
class Calibrated(Protocol):
    """A tokenizer whose counts are estimates calibrated on sampled prompts."""

    calibration: CountCalibration
    sampled: int


class CalibrationCollector:
    """The current tokenizer's calibration as Prometheus metrics, when it has one."""

    def __init__(self, pool: str, current: Callable[[], PromptTokenizer]) -> None:
        self.pool, self.current = pool, current

    def collect(self) -> Iterator[Metric]:
        tokenizer = self.current()
        if not isinstance(tokenizer, Calibrated):
            return
        calibration = tokenizer.calibration
        error = math.nan if calibration.last_error is None else calibration.last_error
        for family, name, documentation, value in (
            (
                GaugeMetricFamily,
                "llm_epp_tokenizer_bytes_per_token",
                "Bytes of prompt text per estimated token (measured on the sampled prompts)",
                calibration.bytes_per_token,
            ),
            (
                GaugeMetricFamily,
                "llm_epp_tokenizer_estimate_error",
                "Mean relative error of the estimated prompt token counts over the last window of "
                "sampled prompts (NaN before the first window)",
                error,
            ),
            (
                CounterMetricFamily,
                "llm_epp_tokenizer_sampled_prompts",
                "Prompts also tokenized by the model's tokenizer to calibrate the estimate",
                tokenizer.sampled,
            ),
            (
                CounterMetricFamily,
                "llm_epp_tokenizer_ratio_changes",
                "Times the estimate's bytes per token moved (each starts prefix affinity over)",
                calibration.changes,
            ),
        ):
            metric = family(name, documentation, labels=["name"])
            metric.add_metric([self.pool], value)
            yield metric
