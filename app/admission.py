"""Admission control, and the bridge from the scheduler's threads to the event loop.

At most ``max_queue`` requests are in flight (loading, waiting, running or
pre-encoding); the next one gets 429 with ``Retry-After`` before any response
starts. Admitted work runs on a small pool of prepare threads, never on the
event loop or the model thread: a generation's preparation (memory, store
probe, prefix load) ends by handing it to the step loop, whose events then
arrive here. A consumer that goes away (a client that disconnected) sets the
request's cancel flag; the scheduler drops the request at its next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.errors import Overloaded
from scheduler.generation import Finished

T = TypeVar("T")
Emit = Callable[[Any], None]
StreamJob = Callable[[Emit, threading.Event], None]


class Admission:
    def __init__(self, max_queue: int, threads: int, initializer: Callable[[], None] | None = None) -> None:
        self.max_queue = max_queue
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="prepare", initializer=initializer
        )
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

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Admit, run ``fn(*args)`` on a prepare thread, and wait for its result."""
        self._admit()
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        finally:
            self._release()

    def stream(self, job: StreamJob) -> EventStream:
        """Admit now (so 429 comes before any response starts); iterate the job's events.

        The job runs on a prepare thread with ``(emit, cancel)``; the events end
        with a ``Finished`` or an exception, which is raised here.
        """
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

        try:
            self._pool.submit(run)
        except RuntimeError:  # the pool is shut down
            self._release()
            raise

        return EventStream(queue, cancel, self._release)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class EventStream:
    """One admitted job's events. Closing it (at the end, on an error, by ``aclose``, or when it
    is dropped unread) cancels the job and gives its admission back, exactly once."""

    def __init__(
        self, queue: asyncio.Queue[Any], cancel: threading.Event, release: Callable[[], None]
    ) -> None:
        self._queue = queue
        self._cancel = cancel
        self._release: Callable[[], None] | None = release

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Any:
        if self._release is None:
            raise StopAsyncIteration
        try:
            event = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        if isinstance(event, BaseException):
            self.close()
            raise event
        if isinstance(event, Finished):
            self.close()
        return event

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            self._cancel.set()
            release()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
