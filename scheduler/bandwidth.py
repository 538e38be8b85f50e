"""Link bandwidth, estimated from the transfers the gateway makes anyway.

Chunk fetches run several at a time, so one fetch's bytes over its own time
underestimates the link by the number in flight. The estimator instead counts
the bytes delivered while at least one fetch was in flight, over the time
that was so ("busy time"), and folds that into a moving average weighted by
busy time: recent transfers dominate within ``half_life_s`` of link time. One
estimator per store, kept across requests; no configured link speed.
"""

from __future__ import annotations

import math
import threading
import time


class BandwidthEstimator:
    def __init__(self, half_life_s: float = 0.05, min_sample_s: float = 0.004) -> None:
        self.half_life_s = half_life_s
        self.min_sample_s = min_sample_s  # shorter samples are mostly round-trip time: pooled first
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0  # busy time not yet folded into the estimate
        self._bytes = 0  # bytes delivered in that time
        self._rate: float | None = None  # bytes per second
        self.samples = 0

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
            if self._busy_s >= self.min_sample_s and self._bytes > 0:
                self._fold(self._bytes / self._busy_s, self._busy_s)
                self._busy_s = 0.0
                self._bytes = 0

    def _fold(self, rate: float, weight_s: float) -> None:
        self.samples += 1
        if self._rate is None:
            self._rate = rate
            return
        keep = math.exp(-math.log(2) * weight_s / self.half_life_s)
        self._rate = keep * self._rate + (1 - keep) * rate

    @property
    def bytes_per_second(self) -> float | None:
        """The estimate, or None before the first transfer completed."""
        return self._rate
