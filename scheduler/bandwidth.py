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
class Estimate:
    """A rate with what it rests on, read together."""

    bytes_per_second: float | None  # None before the first transfer completed
    busy_s: float  # the transfer time of the window it came from
    transfers: int  # in that window
    last_end: float  # when the latest transfer ended (``time.perf_counter``; 0 before any)


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
        self._transfers = 0  # in that window
        self._last_end = 0.0

    def begin(self) -> float:
        """Call when a transfer starts; hand the result to ``end``."""
        return time.perf_counter()

    def end(self, started: float, nbytes: int) -> None:
        """A transfer finished (``nbytes`` = 0 for a failed one: its time still counts)."""
        with self._lock:
            self._last_end = time.perf_counter()
            self._done.append(_Transfer(started, self._last_end, nbytes))
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
        self._transfers = len(window)
        return moved / busy

    @property
    def bytes_per_second(self) -> float | None:
        """The estimate, or None before the first transfer completed."""
        return self._rate

    def snapshot(self) -> Estimate:
        """The estimate and what it rests on, as of one transfer (not torn by another's ``end``)."""
        with self._lock:
            return Estimate(self._rate, self._busy_s, self._transfers, self._last_end)


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
    at the overall estimate, raised to the store's floor (a local directory's
    ``prior_bytes_per_second``): what the store claims for large reads, tried before a small
    level's rate is taken for it. A store with no floor (a link: S3, MinIO) plans every level at
    the overall estimate, as before: there the per-level estimates made a tight budget's plans
    price ``low`` from its own small transfers and overshoot the budget
    (``tests/integration/test_gateway_adaptive.py`` failed 2 of 4 runs; 2 of 2 passed before),
    where the overall estimate meets it.

    Under a floor, a level's own estimate counts once it rests on
    ``evidence_s`` of transfers or ``evidence_transfers`` of them: the first reads of a fresh
    process on a cold disk are the slow ones (two 11 MiB reads took 14-22 ms, later ones 9-13
    ms), so the floor holds until a few reads say otherwise, and a slow disk says so in one.

    A level's own estimate changes only when that level is read, so one that no plan has read for
    ``stale_s`` while others were (a level measured during congestion, which then looked too slow
    to plan) goes back to the overall estimate and the floor, and is read and measured again when
    that makes it worth planning. Transfers of two levels that overlap each read only their share
    of the link, so an own estimate can be low, never high.
    """

    def __init__(
        self,
        window_s: float = 0.2,
        evidence_s: float = 0.025,
        evidence_transfers: int = 4,
        stale_s: float = 10.0,
    ) -> None:
        self._window_s = window_s
        self.evidence_s = evidence_s
        self.evidence_transfers = evidence_transfers
        self.stale_s = stale_s
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
        """The rate to plan each level's transfers at. Without a ``floor`` (a link), ``fallback``
        (the overall estimate, or the prior before it) for every level. With one (a local
        directory): a level's own estimate, else (none yet, or stale) ``fallback`` raised to the
        floor; an own estimate below the floor that rests on too little (``evidence_s``,
        ``evidence_transfers``) gives the floor."""
        if floor is None:
            return dict.fromkeys(names, fallback)
        unmeasured = max(fallback, floor)
        latest = self.overall.snapshot().last_end
        rates = {}
        for name in names:
            estimator = self._levels.get(name)
            own = None if estimator is None else estimator.snapshot()
            if own is None or own.bytes_per_second is None or latest - own.last_end > self.stale_s:
                rates[name] = unmeasured
            elif own.busy_s < self.evidence_s and own.transfers < self.evidence_transfers:
                rates[name] = max(own.bytes_per_second, floor)
            else:
                rates[name] = own.bytes_per_second
        return rates
