"""Link bandwidth, estimated from the transfers the gateway makes anyway.

Chunk fetches run several at a time and share the link, and they complete in
bunches: fetches that shared the link finish together. Crediting a fetch's
bytes at its completion therefore reads a burst (an early version read 49
Mbps on a 20 Mbps link), and dividing one fetch's bytes by its own time reads
too little (by the number in flight). So each completed fetch's bytes are
spread evenly over its own interval, and the estimate is the bytes that fall
inside a recent window, over the time in that window when at least one of
those fetches was in flight ("busy time"). The window reaches back at least
``window_s``, and at least over the longest of the fetches in it, so a bunch
is always seen whole. Fetches still in flight are not counted yet, which can
only make the estimate low, never high. One estimator per store, kept across
requests; no configured link speed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class _Transfer:
    start: float
    end: float
    nbytes: int


class BandwidthEstimator:
    def __init__(self, window_s: float = 0.2, min_busy_s: float = 0.004, keep: int = 64) -> None:
        self.window_s = window_s
        self.min_busy_s = min_busy_s  # less than this is mostly round-trip time: no estimate yet
        self._lock = threading.Lock()
        self._done: deque[_Transfer] = deque(maxlen=keep)
        self._rate: float | None = None

    def begin(self) -> float:
        """Call when a transfer starts; hand the result to ``end``."""
        return time.perf_counter()

    def end(self, started: float, nbytes: int) -> None:
        """A transfer finished (``nbytes`` = 0 for a failed one: its time still counts)."""
        with self._lock:
            self._done.append(_Transfer(started, time.perf_counter(), nbytes))
            self._rate = self._estimate()

    def _estimate(self) -> float | None:
        latest = max(t.end for t in self._done)
        horizon = latest - self.window_s
        # widen the window until it holds every transfer that overlaps it whole
        while True:
            earliest = min((t.start for t in self._done if t.end > horizon), default=horizon)
            if earliest >= horizon:
                break
            horizon = earliest
        window = [t for t in self._done if t.end > horizon]
        busy = _union_length([(max(t.start, horizon), t.end) for t in window])
        moved = sum(t.nbytes for t in window)
        if busy < self.min_busy_s or moved == 0:
            return self._rate
        return moved / busy

    @property
    def bytes_per_second(self) -> float | None:
        """The estimate, or None before the first transfer completed."""
        return self._rate


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
