"""Admission control, and the bridge from the scheduler's threads to the event loop.

At most ``max_queue`` requests are in flight (loading, waiting, running or
pre-encoding); the next one gets 429 with ``Retry-After`` before any response
starts. An admitted generation is handed to the scheduler
(``RequestExecutor.start``), which never blocks the event loop: its events
arrive here from the scheduler's threads. A consumer that goes away (a client
that disconnected) sets the request's cancel flag (a ``scheduler.flag.Flag``,
which also tells what waits on the request's behalf); the scheduler drops the
request at its next step.

Pre-encodes (``background``) are long (a prefill and an encode of a whole
context) and run on a pool of their own, so they never take the prepare
threads that interactive requests load on; the step loop serves their prefill
after every interactive one. Each tenant may have ``max_encodes_per_tenant`` of them
in flight; the next gets 429 with ``Retry-After``, so one tenant's burst of
pre-encodes cannot queue the others' behind it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.errors import Overloaded, TooManyEncodes
from app.threads import lower_priority
from scheduler.flag import Flag
from scheduler.generation import Finished

T = TypeVar("T")
Emit = Callable[[Any], None]
StreamJob = Callable[[Emit, threading.Event], None]


class Admission:
    def __init__(
        self,
        max_queue: int,
        initializer: Callable[[], None] | None = None,
        *,
        encode_threads: int = 2,
        max_encodes_per_tenant: int = 2,
    ) -> None:
        self.max_queue = max_queue
        self.max_encodes_per_tenant = max_encodes_per_tenant
        self._encode_pool = ThreadPoolExecutor(
            max_workers=encode_threads, thread_name_prefix="encode", initializer=_background(initializer)
        )
        self._lock = threading.Lock()
        self._admitted = 0
        self._encoding: dict[str | None, int] = {}  # tenant id -> pre-encodes in flight

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

    async def background(
        self, tenant: str | None, fn: Callable[..., T], *args: Any, cancel: threading.Event
    ) -> T:
        """Admit a pre-encode of ``tenant`` (None: no tenants) and run ``fn(*args, cancel)`` on
        the encode pool. Leaving (the awaiting task cancelled) sets ``cancel``; the admission is
        given back when ``fn`` has returned, not before, so a tenant's limit counts work that is
        still running."""
        with self._lock:
            running = self._encoding.get(tenant, 0)
            if running >= self.max_encodes_per_tenant:
                raise TooManyEncodes(
                    f"{running} pre-encodes of this tenant are running (the limit is "
                    f"{self.max_encodes_per_tenant}): try again when one has finished"
                )
            self._encoding[tenant] = running + 1
        try:
            self._admit()
        except Overloaded:
            self._end_encode(tenant)
            raise
        try:
            future = self._encode_pool.submit(fn, *args, cancel)
        except RuntimeError:  # the pool is shut down
            self._end_encode(tenant)
            self._release()
            raise

        def done(_: Any) -> None:
            self._end_encode(tenant)
            self._release()

        future.add_done_callback(done)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _end_encode(self, tenant: str | None) -> None:
        with self._lock:
            left = self._encoding[tenant] - 1
            if left:
                self._encoding[tenant] = left
            else:
                del self._encoding[tenant]

    def stream(self, job: StreamJob) -> EventStream:
        """Admit now (so 429 comes before any response starts); iterate the job's events.

        The job is started here with ``(emit, cancel)`` and must not block; its
        events, from any thread, end with a ``Finished`` or an exception, which is
        raised here.
        """
        self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = Flag()

        def emit(event: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            job(emit, cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            emit(exc)
        return EventStream(queue, cancel, self._release)

    def shutdown(self) -> None:
        self._encode_pool.shutdown(wait=False, cancel_futures=True)


def _background(initializer: Callable[[], None] | None) -> Callable[[], None]:
    def init() -> None:
        if initializer is not None:
            initializer()
        lower_priority()

    return init


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
