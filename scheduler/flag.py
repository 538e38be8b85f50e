"""A flag that also tells whoever waits on it without a thread: a request's cancel flag, and the
signal that the first of a request's ``n`` choices has its prompt in memory.

Code that is running checks the flag where it is (``is_set``). Work that waits
without a thread (a KV reservation in the queue, a choice waiting for its
sibling's prompt) registers a callback instead (``when_set``): it runs once,
on the thread that sets the flag, or at once if the flag is already set. A
callback must be short and must not block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Flag(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            if self.is_set():
                return
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call(callback)

    def add_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        _call(callback)


def when_set(flag: threading.Event | None, callback: Callable[[], None]) -> None:
    """Call ``callback`` when ``flag`` is set, if it can say so (a ``Flag``); a plain
    ``threading.Event`` is only seen by those who check it."""
    if isinstance(flag, Flag):
        flag.add_callback(callback)


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # one waiter's bug must not keep the flag from the others
        log.exception("a flag's callback failed")
