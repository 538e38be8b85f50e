"""Link bandwidth, estimated from the transfers the gateway makes anyway.

Chunk fetches run several at a time and share the link, so neither one
fetch's bytes over its own time (too low by the number in flight) nor bytes
over the gap between two completions (fetches that shared the link finish
together: far too high) measure it. The estimator counts "busy time", when
at least one fetch is in flight, and divides the bytes completed over the
last ``window_s`` of busy time by that time. The window spans a whole round
of concurrent fetches, so bytes credited at completion even out, and it is
short enough to follow a link that changes within a request. One estimator
per store, kept across requests; no configured link speed.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class BandwidthEstimator:
    def __init__(self, window_s: float = 0.2, min_busy_s: float = 0.004) -> None:
        self.window_s = window_s
        self.min_busy_s = min_busy_s  # less than this is mostly round-trip time: no estimate yet
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0  # total busy time
        self._bytes = 0  # total bytes completed
        # (busy time, bytes) after each completion; the first entry is the origin
        self._marks: deque[tuple[float, int]] = deque([(0.0, 0)])
        self._rate: float | None = None

    def begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def end(self, nbytes: int) -> None:
        """A transfer finished (``nbytes`` = 0 for a failed one: its time still counts)."""
        with self._lock:
            now = time.perf_counter()
            self._busy_s += now - self._busy_since
            self._busy_since = now
            self._in_flight -= 1
            self._bytes += nbytes
            # keep the newest mark at least a window old, and everything after it
            while len(self._marks) > 1 and self._busy_s - self._marks[1][0] >= self.window_s:
                self._marks.popleft()
            busy0, bytes0 = self._marks[0]
            if self._busy_s - busy0 >= self.min_busy_s and self._bytes > bytes0:
                self._rate = (self._bytes - bytes0) / (self._busy_s - busy0)
            self._marks.append((self._busy_s, self._bytes))

    @property
    def bytes_per_second(self) -> float | None:
        """The estimate, or None before the first transfer completed."""
        return self._rate
