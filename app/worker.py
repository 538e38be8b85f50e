"""The model's single worker thread, and admission control in front of it.

One request runs on the model at a time (a CPU gateway has no spare cores to
batch on); the rest wait, up to ``max_queue`` in all, and the next one gets
429. A streaming client that goes away sets the job's cancel flag, the job
stops at its next token, and its slot frees.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.errors import Overloaded
from app.metrics import Metrics

T = TypeVar("T")
Emit = Callable[[Any], None]
StreamJob = Callable[[Emit, threading.Event], None]

_DONE = object()


class ModelWorker:
    def __init__(self, max_queue: int, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._lock = threading.Lock()
        self._admitted = 0

    @property
    def admitted(self) -> int:
        return self._admitted

    def _admit(self) -> None:
        with self._lock:
            if self._admitted >= self.max_queue:
                raise Overloaded(f"server is busy: {self._admitted} requests in flight, try again later")
            self._admitted += 1
            self.metrics.waiting.inc()

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def _wrap(self, fn: Callable[..., T], *args: Any) -> Callable[[], T]:
        def run() -> T:
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            try:
                return fn(*args)
            finally:
                self.metrics.running.dec()
                self._release()

        return run

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread and wait for its result."""
        self._admit()
        future = self._executor.submit(self._wrap(fn, *args))
        return await asyncio.wrap_future(future)

    def stream(self, job: StreamJob) -> AsyncIterator[Any]:
        """Admit now (so 429 comes before any response starts); iterate the job's events."""
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def run() -> None:
            try:
                job(emit, cancel)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                emit(exc)
            finally:
                emit(_DONE)

        self._executor.submit(self._wrap(run))

        async def events() -> AsyncIterator[Any]:
            try:
                while True:
                    event = await queue.get()
                    if event is _DONE:
                        return
                    if isinstance(event, BaseException):
                        raise event
                    yield event
            finally:
                cancel.set()

        return events()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
