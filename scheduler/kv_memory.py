"""The KV memory budget: every sequence's buffer is reserved here before it is allocated.

A generation reserves ``(prompt + max_tokens) x bytes per token`` before its
prefix is loaded, and releases it when it finishes, fails or is cancelled; a
pre-encode reserves its context's KV the same way. A reservation that does not
fit waits (first come, first served, so a large request is not starved by
small ones) until enough is released, or until its request is cancelled.
Reserving more than the whole budget fails at once: it could never fit.

A load from the store also reserves, for as long as it runs, the fetched chunks it may
hold at once (``PrefixLoader.staging_bytes``): on a fast store they were the largest
memory outside the budget.

Finished requests' buffers may stay reserved as cached KV
(``scheduler/prefix_cache.py``): ``reclaim`` is asked to free some of them
before a reservation waits, so cached KV never makes a request wait.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class KVMemoryExceeded(ValueError):
    """One request needs more KV memory than the whole budget."""


class KVMemory:
    def __init__(self, budget_bytes: int, reclaim: Callable[[int], int] | None = None) -> None:
        self.budget = budget_bytes
        # frees reserved bytes that are only cache (at least the argument, if it can); returns them
        self.reclaim = reclaim
        self._used = 0
        self._queue: deque[object] = deque()  # tickets of waiting reservations, oldest first
        self._cond = threading.Condition()

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

    def reserve(self, nbytes: int, cancel: threading.Event | None = None, poll_s: float = 0.05) -> bool:
        """Block until ``nbytes`` fit; False if ``cancel`` was set first (nothing is then held)."""
        self.check(nbytes)
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or self._used + nbytes > self.budget:
                    if cancel is not None and cancel.is_set():
                        return False
                    if self._queue[0] is ticket and self.reclaim is not None:
                        freed = self.reclaim(self._used + nbytes - self.budget)
                        if freed:
                            self._used -= freed
                            continue
                    self._cond.wait(poll_s)
                self._used += nbytes
                return True
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` only if they fit now and nobody waits first; never blocks."""
        with self._cond:
            if self._queue or nbytes > self.budget:
                return False
            if self._used + nbytes > self.budget and self.reclaim is not None:
                self._used -= self.reclaim(self._used + nbytes - self.budget)
            if self._used + nbytes > self.budget:
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            assert self._used >= 0, "released more KV memory than was reserved"
            self._cond.notify_all()
