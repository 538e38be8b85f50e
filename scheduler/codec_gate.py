"""One codec operation at a time, and whether one is running now.

Decodes of concurrent prefix loads and encodes of pre-encodes and
write-backs all take the gate, so the codec's CPU work runs on the thread
budget's numba threads, never on as many threads as there are requests.
The step loop reads ``active`` before each step: while the codec works,
torch gets only the cores the codec leaves (see ``app/threads.py``).
"""

from __future__ import annotations

import threading
from typing import Self


class CodecGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> Self:
        self._lock.acquire()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self._lock.release()
