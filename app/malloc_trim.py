"""Give the C allocator's free pages back to the OS, twice a second, when there are many.

``app/allocator.py`` bounds the arenas and sets a trim threshold, but an arena gives back only the
free memory at its top: a long-lived block (an LRU tier entry, a Python object) above freed ones
pins them. After 8 pre-encodes and 16 questions on them (``benchmarks/memory_bench.py``'s
workload), the main arena held 1,345 MB, of which 697 MB were in use, and one ``malloc_trim(0)``,
which also gives back free pages inside an arena, took the RSS from 4,180 to 3,884 MiB, in a few
milliseconds. A second round of 16 questions then added 8 MiB: the pages were not needed again.

``Trimmer`` runs it when the RSS passes its high mark (the RSS before the last trim) by more than
``CACHEGEN_MALLOC_TRIM_GROWTH_BYTES`` and the arenas hold that much free; the gateway asks it
every ``CACHEGEN_MALLOC_TRIM_INTERVAL_S`` (0.5 s; 0: never).
Under 32 clients (``benchmarks/memory_bench.py``) the peak RSS fell from 1.32x to 1.23x the
bound, and the median sample to 1.17x; a trim takes about 1.5 ms (docs/serving.md, "Peak memory
under load").
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from functools import cache

from app.allocator import glibc
from app.settings import Settings
from scheduler.lifecycle import PeriodicTask

log = logging.getLogger(__name__)

_MALLINFO2_FIELDS = (
    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
)  # fmt: skip


@cache
def _mallinfo2() -> Callable[[], ctypes.Structure] | None:
    """glibc's ``mallinfo2`` (2.33 and later), returning its struct of ``size_t`` counts; None without it."""
    libc = glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]

    libc.mallinfo2.restype = Mallinfo2
    return libc.mallinfo2


def free_bytes() -> int | None:
    """What the arenas hold free (``mallinfo2().fordblks``); None without glibc's mallinfo2."""
    mallinfo2 = _mallinfo2()
    return None if mallinfo2 is None else int(mallinfo2().fordblks)


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim_now() -> int:
    """One ``malloc_trim(0)`` now, whatever the high mark: after a known large free (start-up's
    release of the plain projection weights). The bytes the RSS fell by; 0 without glibc."""
    libc = glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    rss = _rss_bytes()
    libc.malloc_trim(ctypes.c_size_t(0))
    return max(0, rss - _rss_bytes())


class Trimmer:
    """Each call gives the arenas' free pages back to the OS (``malloc_trim(0)``) when the RSS
    passes its high mark by more than ``growth_bytes`` and the arenas hold more than that free.
    The high mark is the RSS just before the last trim (at first, the first call's reading). What
    the RSS fell by and how long the trim took go to ``on_trim(released_bytes, seconds)``.

    Why a high mark: free bytes alone cannot tell resident pages from given-back ones (a trim gives
    back the pages inside free chunks, the chunks stay free), so on free bytes alone every call
    would trim again. And a trim gives back a model step's just-freed activations too, which the
    next step faults in again: measured, trimming over 64 MiB free every 0.5 s cost 4% of the
    tokens/s at 8 clients. Memory that comes back up to the high mark is such a working set, and
    is left alone; only a new high, which is what a peak is made of, trims."""

    def __init__(self, growth_bytes: int, on_trim: Callable[[int, float], None] | None = None) -> None:
        self.growth_bytes = growth_bytes
        self._on_trim = on_trim
        self._libc = glibc()
        self._high: int | None = None

    @property
    def available(self) -> bool:
        return self._libc is not None and _mallinfo2() is not None

    def __call__(self) -> int:
        """The bytes the RSS fell by (0 when nothing was done)."""
        rss = _rss_bytes()
        if self._high is None:
            self._high = rss
        if rss - self._high <= self.growth_bytes:
            return 0
        free = free_bytes()
        if self._libc is None or free is None or free <= self.growth_bytes:
            return 0
        t0 = time.perf_counter()
        self._libc.malloc_trim(ctypes.c_size_t(0))
        seconds, released = time.perf_counter() - t0, max(0, rss - _rss_bytes())
        self._high = rss
        log.debug("malloc_trim: %d MiB free in the arenas, RSS -%d MiB in %.1f ms",
                  free >> 20, released >> 20, 1e3 * seconds)  # fmt: skip
        if self._on_trim is not None:
            self._on_trim(released, seconds)
        return released


def trim_task(settings: Settings, on_trim: Callable[[int, float], None] | None = None) -> PeriodicTask | None:
    """The gateway's periodic trim, or None: without the malloc tuning, with a zero interval, or
    without glibc's ``malloc_trim`` and ``mallinfo2``."""
    if not settings.malloc_tuning or settings.malloc_trim_interval_s <= 0:
        return None
    trimmer = Trimmer(settings.malloc_trim_growth_bytes, on_trim)
    return PeriodicTask(trimmer, settings.malloc_trim_interval_s, "malloc-trim") if trimmer.available else None
