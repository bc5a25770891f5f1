"""Runs an engine in real time on the event loop and hands each request its tokens.

The loop is vLLM's engine-core loop with the forward pass replaced by a sleep::

    wait for work -> schedule(now) -> sleep until the step's end -> finish_step(now) -> deliver

While busy, steps follow each other on the engine's timeline (each starts where the previous
one ended), so the event loop's wake-up lateness does not stretch every step.

Each step's lag (when it started minus when it was due) goes to ``on_step_lag``: a step is due
when the previous one ended, or, on an idle engine, at the last submit before it. A process
starved of CPU runs its steps late, and that shows there rather than as slow routing.

Requests are submitted and aborted from HTTP handlers at any moment; the engine tolerates an
abort while a step is in flight (the aborted request's blocks are freed at once and its part of
the step is dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from sim.engine import Engine, EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

MAX_TIMELINE_LAG_S = 0.005


def timeline_time(now: float, planned: float | None, not_before: float = -math.inf) -> float:
    """The time to give the engine: ``planned`` if the loop is only slightly late for it.

    asyncio wakes up to a millisecond late; stepping on the engine's own timeline keeps that
    from adding to every step. Lags beyond ``MAX_TIMELINE_LAG_S`` (a busy event loop) are not
    made up. Never earlier than ``not_before`` (the last submit), so no request is scheduled
    before it arrived.
    """
    if planned is None or now - planned > MAX_TIMELINE_LAG_S:
        return now
    return max(planned, not_before)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestStream:
    """The outputs of one submitted request, in order, ending with the one that finishes it."""

    __slots__ = ("_queue", "request")

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class EngineDriver:
    """Owns one engine and the asyncio task that steps it in real (``clock``) time.

    ``on_step`` is called with each step's outputs before they are delivered (metrics), and
    ``on_step_lag`` with each step's lag in seconds as it starts. The task starts with the first
    ``submit`` in the running event loop.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        on_step_lag: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_step_lag = on_step_lag
        self._clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: EngineDeadError | None = None
        self._last_submit = -math.inf

    def now(self) -> float:
        """The driver's clock (seconds, monotonic)."""
        return self._clock()

    def submit(self, request: EngineRequest) -> RequestStream:
        """Add a request to the engine; raises RequestRejectedError or EngineDeadError."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        self._last_submit = self._clock()
        self.engine.add_request(request, self._last_submit)
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-driver")
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; a no-op if it already finished."""
        self._streams.pop(request_id, None)
        if self.engine.abort_request(request_id, self._clock()) is not None:
            self._wake.set()

    async def stop(self) -> None:
        """Cancel the loop; requests still waiting for tokens, and later submits, get EngineDeadError."""
        self._error = self._error or EngineDeadError("the server is shutting down")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all(self._error)

    async def _run(self) -> None:
        engine = self.engine
        timeline: float | None = None  # end of the previous step while steps run back to back
        due: float | None = None  # when the next step should start (the previous step's end)
        try:
            while True:
                if not engine.has_unfinished_requests():
                    timeline = due = None
                    self._wake.clear()
                    await self._wake.wait()
                now = self._clock()
                step = engine.schedule(timeline_time(now, timeline, self._last_submit))
                if step is None:
                    # Unreachable while requests are unfinished (the head of the queue always fits
                    # an idle cache); if it ever happens, wait for news instead of spinning.
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if self._on_step_lag is not None:
                    self._on_step_lag(max(0.0, now - (self._last_submit if due is None else due)))
                # Always yield, so handlers run even when steps take no time.
                await asyncio.sleep(max(0.0, step.end_time - self._clock()))
                due = step.end_time
                timeline = timeline_time(self._clock(), step.end_time)
                outputs = engine.finish_step(step, timeline)
                if self._on_step is not None:
                    self._on_step(outputs)
                self._deliver(outputs)
        except Exception as exc:
            logger.exception("engine loop failed")
            self._error = EngineDeadError(f"the engine loop failed: {exc!r}")
            self._fail_all(self._error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            request_id = output.request.request_id
            stream = streams.get(request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finish_reason is not None:
                del streams[request_id]

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
