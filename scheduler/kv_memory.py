"""The KV memory budget: every sequence's buffer is reserved here before it is allocated.

A generation reserves ``(prompt + max_tokens) x bytes per token`` before its
prefix is loaded, and releases it when it finishes, fails or is cancelled; a
pre-encode reserves its context's KV the same way. A reservation that does not
fit waits in a queue (first come, first served, so a large request is not
starved by small ones) until enough is released, or until its request is
cancelled. Reserving more than the whole budget fails at once: it could never fit.

Waiting takes no thread: ``reserve_async`` returns a future that is granted
by whoever frees the memory (``release``), or answered False when the request's
cancel flag (a ``scheduler.flag.Flag``) is set. ``reserve`` is the same,
waited for, for callers with a thread of their own (a pre-encode, the CLI).

A load from the store also reserves, for as long as it runs, the fetched chunks it may
hold at once (``PrefixLoader.staging_bytes``): on a fast store they were the largest
memory outside the budget.

Finished requests' buffers may stay reserved as cached KV
(``scheduler/prefix_cache.py``): ``reclaim`` is asked to free some of them
before a reservation waits, so cached KV that nobody reads never makes a
request wait (a run that a request reads, pinned, stays until that request
lets go; a request that waits holds no pin: ``RequestExecutor._admit``). Every
change to the cache that could free memory ends in a ``release`` call (of 0
bytes, if need be), so the queue is looked at again whenever memory might fit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from scheduler.flag import when_set


class KVMemoryExceeded(ValueError):
    """One request needs more KV memory than the whole budget."""


@dataclass(eq=False)
class _Ticket:
    nbytes: int
    cancel: threading.Event | None
    future: Future[bool] = field(default_factory=Future)


class KVMemory:
    def __init__(self, budget_bytes: int, reclaim: Callable[[int], int] | None = None) -> None:
        self.budget = budget_bytes
        # frees reserved bytes that are only cache (at least the argument, if it can); returns them
        self.reclaim = reclaim
        self._used = 0
        self._queue: deque[_Ticket] = deque()  # waiting reservations, oldest first
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def check(self, nbytes: int) -> None:
        if nbytes > self.budget:
            raise KVMemoryExceeded(
                f"the request needs {nbytes / 2**20:.0f} MiB of KV memory; the budget "
                f"(CACHEGEN_KV_MEMORY_BYTES) is {self.budget / 2**20:.0f} MiB"
            )

    def reserve_async(self, nbytes: int, cancel: threading.Event | None = None) -> Future[bool]:
        """A future of whether ``nbytes`` were reserved: True once they fit and every earlier
        reservation was served, False if ``cancel`` was set first (nothing is then held). It may
        be done on return; its callbacks run on the thread that grants it, so they must be short."""
        self.check(nbytes)
        ticket = _Ticket(nbytes, cancel)
        with self._lock:
            self._queue.append(ticket)
            answered = self._serve()
        _answer(answered)
        if not ticket.future.done():
            when_set(cancel, self._look_again)
        return ticket.future

    def reserve(self, nbytes: int, cancel: threading.Event | None = None) -> bool:
        """``reserve_async``, waited for on the calling thread."""
        return self.reserve_async(nbytes, cancel).result()

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` only if they fit now and nobody waits first; never blocks."""
        with self._lock:
            if self._queue or nbytes > self.budget:
                return False
            if not self._fits(nbytes):
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            assert self._used >= 0, "released more KV memory than was reserved"
            answered = self._serve()
        _answer(answered)

    def _look_again(self) -> None:
        """A waiting reservation was cancelled: it leaves the queue, and those behind it may fit."""
        with self._lock:
            answered = self._serve()
        _answer(answered)

    # -- under the lock --------------------------------------------------------------------------

    def _serve(self) -> list[tuple[_Ticket, bool]]:
        """Take the cancelled reservations out of the queue and grant the first ones that fit, in
        order; what to tell their futures (outside the lock: their callbacks run then)."""
        answered = []
        for ticket in [t for t in self._queue if t.cancel is not None and t.cancel.is_set()]:
            self._queue.remove(ticket)
            answered.append((ticket, False))
        while self._queue and self._fits(self._queue[0].nbytes):
            ticket = self._queue.popleft()
            self._used += ticket.nbytes
            answered.append((ticket, True))
        return answered

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit, after asking the cache to free what it must."""
        over = self._used + nbytes - self.budget
        if over > 0 and self.reclaim is not None:
            self._used -= self.reclaim(over)
        return self._used + nbytes <= self.budget


def _answer(answered: list[tuple[_Ticket, bool]]) -> None:
    for ticket, granted in answered:
        ticket.future.set_result(granted)
