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
        self._busy_s = 0.0  # of the window the estimate came from

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
        self._busy_s = busy
        return moved / busy

    @property
    def bytes_per_second(self) -> float | None:
        """The estimate, or None before the first transfer completed."""
        return self._rate

    @property
    def busy_seconds(self) -> float:
        """The transfer time the estimate rests on: the busy time of the window it came from."""
        return self._busy_s


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class LinkRates:
    """The link's rate for each level's transfers, beside the overall estimate.

    A transfer pays a per-request cost (a round trip, a cold disk read's latency) besides its
    bytes, so small transfers read a lower rate than large ones get: on this project's VM a
    0.5 MiB ``medium`` chunk read from disk measured 0.3-0.5 GB/s and an 11 MiB lossless chunk
    1.6 GB/s, two at a time. Pricing a lossless fetch at the rate of the small ones made a fresh
    process's stored load decode ``medium`` for 150-180 ms, where lossless took 110-130 ms. So
    each level's transfers get an estimate of their own, and a level not measured yet is priced
    at the overall estimate, raised to the store's floor where it has one (a local directory's
    ``prior_bytes_per_second``): what the store claims for large reads, tried before a small
    level's rate is taken for it. Under a floor, a level's own estimate counts once it rests on
    ``evidence_s`` of transfers: the first reads of a fresh process on a cold disk are the slow
    ones (two 11 MiB reads took 14-22 ms, later ones 9-13 ms), so the floor holds until a few
    reads say otherwise, and a slow disk says so in one. A level's own estimate is as old as its
    last transfer; a plan that leans on a stale one fetches that level, which measures it again
    within a chunk or two.
    """

    def __init__(self, window_s: float = 0.2, evidence_s: float = 0.025) -> None:
        self._window_s = window_s
        self.evidence_s = evidence_s
        self.overall = BandwidthEstimator(window_s)
        self._levels: dict[str, BandwidthEstimator] = {}
        self._lock = threading.Lock()

    def begin(self) -> float:
        return self.overall.begin()

    def end(self, started: float, nbytes: int, level: str | None = None) -> None:
        """A transfer of ``level``'s bytes finished (``nbytes`` = 0 for a failed one)."""
        self.overall.end(started, nbytes)
        if level is None:
            return
        with self._lock:
            estimator = self._levels.setdefault(level, BandwidthEstimator(self._window_s))
        estimator.end(started, nbytes)

    @property
    def bytes_per_second(self) -> float | None:
        """The overall estimate, or None before the first transfer completed."""
        return self.overall.bytes_per_second

    def level(self, name: str) -> float | None:
        """``name``'s own estimate, or None before one of its transfers completed."""
        estimator = self._levels.get(name)
        return None if estimator is None else estimator.bytes_per_second

    def for_levels(self, names: list[str], fallback: float, floor: float | None = None) -> dict[str, float]:
        """The rate to plan each level's transfers at: its own estimate, else ``fallback`` (the
        overall estimate, or the prior before it) raised to ``floor``; under a floor, an own
        estimate below it that rests on less than ``evidence_s`` of transfers gives the floor."""
        unmeasured = max(fallback, floor or 0.0)
        rates = {}
        for name in names:
            estimator = self._levels.get(name)
            own = None if estimator is None else estimator.bytes_per_second
            if own is None:
                rates[name] = unmeasured
            elif floor is not None and estimator.busy_seconds < self.evidence_s:
                rates[name] = max(own, floor)
            else:
                rates[name] = own
        return rates
