"""Client of the predictor and trainer sidecars.

Predictions: concurrent ``predict`` calls are merged into one ``POST /predict/bulk/strict`` to
one predictor instance, chosen round robin among those whose circuit breaker is closed, with at
most ``max_concurrent_calls`` in flight. With no call in flight, the calls made in the same
event-loop turn go out together at the end of that turn; while calls are in flight, those that
arrive within ``coalesce_window_s`` (1 ms) are merged, so waiting for the window costs only
when it saves calls. Every caller waits at most ``timeout_s`` (400 ms) and then gets
:class:`PredictionUnavailable`; so do callers when every instance's breaker is open or the
predictors have no model yet. Callers fall back to heuristics; the client never blocks
scheduling for longer than its time box.

An instance that answers 503 (no model yet) is not called again for ``warmup_recheck_s``
(0.5 s): while no instance has a model, ``predict`` answers ``warming_up`` at once instead of
paying a round trip per request, and one call per instance per interval finds the first model.

Drift: :meth:`request_retrain` asks the trainer for a fresh model (``POST /retrain``).

Training: samples are buffered (bounded; the oldest are dropped when full) and flushed in
bulk with ``POST /add_training_data_bulk`` every ``flush_interval_s`` (1 s).

HTTP: the sidecars run beside the EPP, over plain HTTP/1.1 (``http://`` URLs only). Each instance
keeps its idle kept-alive connections (:class:`~epp.keepalive_http.KeepAliveHttp`) for the next
call, one per call in flight. With aiohttp a call cost the EPP ~110 µs more CPU (4 rows: 244 µs
against 131–138; 100 rows: 346–391 against 239–263; client CPU of sequential calls to a local
server, load average 2.5–3.0, 2026-12-04).

Prediction calls use the binary form of :mod:`wire.latency_binary` (a float64 matrix of the
rows, a float32 matrix of the predictions), which spares the predictor the JSON of 100 objects
each way. Training samples are encoded with orjson: ``json`` takes about 45 ms per flush of
10,000 samples.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from epp.keepalive_http import Answer, HttpError, KeepAliveHttp
from epp.latency.breaker import CircuitBreaker
from epp.latency.metrics import PredictionMetrics
from epp.scheduling.predictor import Prediction, PredictionUnavailable
from wire.latency import FeatureRowDict, TrainingSampleDict
from wire.latency_binary import (
    CONSTANT_MODELS_HEADER,
    FEATURE_ROWS_TYPE,
    MODEL_VERSION_HEADER,
    PREDICTIONS_TYPE,
    decode_predictions,
    encode_rows,
)

log = logging.getLogger(__name__)

TRAINER_TIMEOUT_S = 5.0
_JSON_HEADERS = {"content-type": "application/json"}
_PREDICT_HEADERS = {"content-type": FEATURE_ROWS_TYPE, "accept": PREDICTIONS_TYPE}


def _json(body: dict[str, Any]) -> bytes:
    """``body`` as JSON; numpy numbers as numbers, NaN as null (refused by the sidecars either way)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(slots=True)
class _Waiter:
    rows: Sequence[FeatureRowDict]
    future: asyncio.Future[list[Prediction]]


class _Connections:
    """A sidecar's kept-alive connections not in use: one is taken per call, and given back after
    a call that ended with an answer."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme != "http" or parts.hostname is None or parts.path not in ("", "/"):
            raise ValueError(f"a sidecar URL is http://HOST:PORT, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._idle: list[KeepAliveHttp] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """One POST; :class:`HttpError` when no answer came (a caller's timeout cancels it)."""
        client = self._idle.pop() if self._idle else KeepAliveHttp(self.host, self.port)
        answer = await client.request("POST", path, body, headers)
        self._idle.append(client)
        return answer

    def close(self) -> None:
        for client in self._idle:
            client.close()
        self._idle.clear()


class _Instance(_Connections):
    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        super().__init__(url)
        self.breaker = breaker
        self.no_model_until = float("-inf")
        """Until then (client clock) the instance is taken to have no model (it answered 503)."""


@dataclass(frozen=True, slots=True)
class PredictorClientSettings:
    """Where the sidecars are, and the client's time box and batching (see the module docstring)."""

    predictor_urls: Sequence[str]
    trainer_url: str | None = None
    """Where training samples go; None: they are not collected."""
    timeout_s: float = 0.4
    coalesce_window_s: float = 0.001
    max_rows_per_call: int = 10_000
    max_concurrent_calls: int = 36
    flush_interval_s: float = 1.0
    max_training_rows_per_flush: int = 10_000
    max_buffered_training_rows: int = 100_000
    warmup_recheck_s: float = 0.5
    trainer_token: str | None = None
    """Bearer token for the trainer's sample intake (an exposed trainer requires one)."""

    def __post_init__(self) -> None:
        if not self.predictor_urls:
            raise ValueError("at least one predictor URL is needed")


class PredictorClient:
    def __init__(
        self, settings: PredictorClientSettings, clock: Callable[[], float], metrics: PredictionMetrics
    ) -> None:
        s = settings
        self.clock = clock
        self.metrics = metrics
        self.timeout_s = s.timeout_s
        self.coalesce_window_s = s.coalesce_window_s
        self.warmup_recheck_s = s.warmup_recheck_s
        self.max_rows_per_call = s.max_rows_per_call
        self.flush_interval_s = s.flush_interval_s
        self.max_training_rows_per_flush = s.max_training_rows_per_flush
        self._trainer = _Connections(s.trainer_url) if s.trainer_url else None
        self._trainer_headers = (
            {**_JSON_HEADERS, "Authorization": f"Bearer {s.trainer_token}"}
            if s.trainer_token
            else _JSON_HEADERS
        )
        self._instances = [_Instance(u, CircuitBreaker(clock)) for u in s.predictor_urls]
        self._next_instance = 0
        self._calls = asyncio.Semaphore(s.max_concurrent_calls)
        self._in_flight = 0
        self._waiting: list[_Waiter] = []
        self._dispatch_handle: asyncio.TimerHandle | None = None
        self._training: deque[TrainingSampleDict] = deque(maxlen=s.max_buffered_training_rows)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._trainer is not None:
            self._spawn(self._flush_training_forever())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connections in [*self._instances, self._trainer]:
            if connections is not None:
                connections.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- predictions ---------------------------------------------------------------------

    async def predict(self, rows: Sequence[FeatureRowDict]) -> list[Prediction]:
        """Predictions for ``rows`` (feature dicts), in order, or :class:`PredictionUnavailable`."""
        if (reason := self._unavailable()) is not None:
            raise PredictionUnavailable(reason)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(rows, loop.create_future())
        self._waiting.append(waiter)
        if self._dispatch_handle is None:
            delay = self.coalesce_window_s if self._in_flight else 0.0
            self._dispatch_handle = loop.call_later(delay, self._dispatch)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            raise PredictionUnavailable("timeout") from None

    def _unavailable(self) -> str | None:
        """Why no instance would take a call now; None when one would."""
        live = [i for i in self._instances if i.breaker.available]
        if not live:
            return "breaker_open"
        now = self.clock()
        if all(now < i.no_model_until for i in live):
            return "warming_up"
        return None

    def _dispatch(self) -> None:
        self._dispatch_handle = None
        waiting, self._waiting = self._waiting, []
        batch: list[_Waiter] = []
        rows = 0
        for waiter in waiting:
            if batch and rows + len(waiter.rows) > self.max_rows_per_call:
                self._spawn(self._call(batch))
                batch, rows = [], 0
            batch.append(waiter)
            rows += len(waiter.rows)
        if batch:
            self._spawn(self._call(batch))

    def _pick_instance(self) -> _Instance | None:
        n = len(self._instances)
        now = self.clock()
        for k in range(n):
            instance = self._instances[(self._next_instance + k) % n]
            if now >= instance.no_model_until and instance.breaker.allow():
                self._next_instance = (self._next_instance + k + 1) % n
                return instance
        return None

    async def _call(self, batch: list[_Waiter]) -> None:
        rows = [row for waiter in batch for row in waiter.rows]
        self.metrics.prediction_batch_rows.observe(len(rows))
        self.metrics.prediction_batch_requests.observe(len(batch))
        instance = self._pick_instance()
        if instance is None:
            _fail(batch, PredictionUnavailable(self._unavailable() or "breaker_open"))
            return
        started = self.clock()
        self._in_flight += 1
        try:
            async with self._calls:
                predictions = await self._post_predict(instance, rows)
        except PredictionUnavailable as exc:
            _fail(batch, exc)
            return
        finally:
            self._in_flight -= 1
            self.metrics.prediction_duration.observe(self.clock() - started)
        offset = 0
        for waiter in batch:
            if not waiter.future.done():
                waiter.future.set_result(predictions[offset : offset + len(waiter.rows)])
            offset += len(waiter.rows)

    async def _post_predict(self, instance: _Instance, rows: list[FeatureRowDict]) -> list[Prediction]:
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await instance.post("/predict/bulk/strict", encode_rows(rows), _PREDICT_HEADERS)
            if answer.status == 503:
                instance.breaker.record_success()  # alive, just no model yet
                instance.no_model_until = self.clock() + self.warmup_recheck_s
                raise PredictionUnavailable("warming_up")
            if answer.status != 200:
                raise PredictionUnavailable(f"http_{answer.status}")
            if answer.headers.get("content-type", "").split(";")[0].strip() != PREDICTIONS_TYPE:
                raise PredictionUnavailable("bad_response")
            predictions = read_predictions(answer.body, answer.headers)
            if len(predictions) != len(rows):
                raise PredictionUnavailable("bad_response")
        except PredictionUnavailable as exc:
            if exc.reason != "warming_up":
                instance.breaker.record_failure()
            raise
        except (HttpError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            instance.breaker.record_failure()
            log.debug("predictor %s failed: %r", instance.url, exc)
            raise PredictionUnavailable("error") from exc
        instance.breaker.record_success()
        return predictions

    # -- training ------------------------------------------------------------------------

    def add_training(self, samples: Sequence[TrainingSampleDict]) -> None:
        """Queue training samples; the oldest are dropped (and counted) when the buffer is full."""
        if self._trainer is None:
            return
        overflow = len(self._training) + len(samples) - (self._training.maxlen or 0)
        if overflow > 0:
            self.metrics.training_rows.labels("dropped").inc(overflow)
        self._training.extend(samples)

    async def flush_training(self) -> int:
        """Send up to one bulk of queued samples now; return how many were accepted."""
        if not self._training or self._trainer is None:
            return 0
        entries = [
            self._training.popleft()
            for _ in range(min(len(self._training), self.max_training_rows_per_flush))
        ]
        try:
            answer = await self._to_trainer("/add_training_data_bulk", _json({"entries": entries}))
            accepted = answer.status in (200, 202)
            if not accepted:
                log.warning(
                    "trainer refused %d samples: HTTP %d %s",
                    len(entries),
                    answer.status,
                    answer.body[:300].decode(errors="replace"),
                )
        except (HttpError, TimeoutError) as exc:
            log.warning("trainer unreachable, %d samples dropped: %r", len(entries), exc)
            accepted = False
        self.metrics.training_rows.labels("sent" if accepted else "dropped").inc(len(entries))
        return len(entries) if accepted else 0

    def request_retrain(self) -> None:
        """Ask the trainer to retrain now (``POST /retrain``), in the background; failures are logged."""
        if self._trainer is not None:
            self._spawn(self._post_retrain())

    async def _post_retrain(self) -> None:
        try:
            answer = await self._to_trainer("/retrain", b"")
        except (HttpError, TimeoutError) as exc:
            log.warning("trainer unreachable for a retrain request: %r", exc)
            return
        if answer.status != 202:
            log.warning("trainer refused a retrain request: HTTP %d", answer.status)
            return
        log.info("asked the trainer to retrain: the predictions drifted")

    async def _to_trainer(self, path: str, body: bytes) -> Answer:
        assert self._trainer is not None
        async with asyncio.timeout(TRAINER_TIMEOUT_S):
            return await self._trainer.post(path, body, self._trainer_headers)

    async def _flush_training_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            while await self.flush_training() >= self.max_training_rows_per_flush:
                pass


def read_predictions(body: bytes, headers: Mapping[str, str]) -> list[Prediction]:
    """The predictions of a ``/predict/bulk/strict`` answer (headers keyed in lower case);
    raises ValueError on a malformed body or version."""
    version_text = headers.get(MODEL_VERSION_HEADER.lower())
    constant_text = headers.get(CONSTANT_MODELS_HEADER.lower())
    version = None if version_text is None else int(version_text)
    constant = tuple(constant_text.split(",")) if constant_text else ()
    return [Prediction(ttft, tpot, version, constant) for ttft, tpot in decode_predictions(body)]


def _fail(batch: list[_Waiter], error: PredictionUnavailable) -> None:
    for waiter in batch:
        if not waiter.future.done():
            waiter.future.set_exception(error)
            waiter.future.exception()  # mark retrieved: a caller that timed out never reads it
