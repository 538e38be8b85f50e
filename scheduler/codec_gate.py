"""One codec operation at a time, whether one is running now, and background work that yields.

Decodes of concurrent prefix loads and encodes of pre-encodes and
write-backs all take the gate, so the codec's CPU work runs on the thread
budget's numba threads, never on as many threads as there are requests.
The step loop reads ``active`` before each step: while the codec works,
torch gets only the cores the codec leaves (see ``app/threads.py``). Each
operation first calls ``before`` under the gate, on its own thread: the
gateway sets the operation's numba threads there, every core while the model
has nothing to run and the budget's share while it has.

Encodes (pre-encodes, write-backs) go through ``background``: before each
encode they wait while ``interactive()`` says interactive requests are on the
model or were a moment ago (the step loop's ``interactive_work``), for at most
``BACKGROUND_MAX_WAIT_S`` (so they are never starved outright). A chat beside a burst of pre-encodes then keeps both cores of a
2-core machine instead of one (``benchmarks/encode_fairness.py``); only an
encode already running when the chat arrives still shares them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Self

BACKGROUND_MAX_WAIT_S = 1.0
_POLL_S = 0.01


class CodecGate:
    def __init__(
        self,
        interactive: Callable[[], bool] = lambda: False,
        before: Callable[[], None] = lambda: None,
    ) -> None:
        self._lock = threading.Lock()
        self._active = False
        # both are the step loop's and the thread budget's, wired once they exist (app/build.py)
        self.interactive = interactive
        self.before = before

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> Self:
        self._lock.acquire()
        self._active = True
        try:
            self.before()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self._lock.release()

    def background(self) -> BackgroundGate:
        """The gate as background work takes it (a reusable context manager)."""
        return BackgroundGate(self)


class BackgroundGate:
    def __init__(self, gate: CodecGate, max_wait_s: float = BACKGROUND_MAX_WAIT_S) -> None:
        self.gate = gate
        self.max_wait_s = max_wait_s

    def __enter__(self) -> CodecGate:
        deadline = time.monotonic() + self.max_wait_s
        while self.gate.interactive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return self.gate.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.gate.__exit__(*exc)
