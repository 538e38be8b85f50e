"""Give the C allocator's free pages back to the OS, twice a second, when there are many.

``app/allocator.py`` bounds the arenas and sets a trim threshold, but an arena gives back only the
free memory at its top: a long-lived block (an LRU tier entry, a Python object) above freed ones
pins them. After 8 pre-encodes and 16 questions on them (``benchmarks/memory_bench.py``'s
workload), the main arena held 1,345 MB, of which 697 MB were in use, and one ``malloc_trim(0)``,
which also gives back free pages inside an arena, took the RSS from 4,180 to 3,884 MiB, in a few
milliseconds. A second round of 16 questions then added 8 MiB: the pages were not needed again.

``Trimmer`` runs it when the arenas hold more than ``CACHEGEN_MALLOC_TRIM_MIN_FREE_BYTES`` free
(256 MiB); the gateway calls it every ``CACHEGEN_MALLOC_TRIM_INTERVAL_S`` (0.5 s; 0: never).
Under 32 clients the peak RSS fell from 1.32x to 1.23x the bound; a trim takes about 1.5 ms.
Pages it gave back are faulted in again when they are reused: with a 64 MiB floor (1.18x) the
tokens/s at 8 clients fell by 4%, with 256 MiB by nothing measurable; the higher floor keeps a
step's activations (about 150 MB for a 256-token prefill) out of reach, presumably the
difference (docs/serving.md, "Peak memory under load").
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


class Trimmer:
    """Each call gives the arenas' free pages back to the OS (``malloc_trim(0)``) if they hold more
    than ``min_free_bytes`` free, and reports what the RSS fell by and how long it took to
    ``on_trim(released_bytes, seconds)``."""

    def __init__(self, min_free_bytes: int, on_trim: Callable[[int, float], None] | None = None) -> None:
        self.min_free_bytes = min_free_bytes
        self._on_trim = on_trim
        self._libc = glibc()

    @property
    def available(self) -> bool:
        return self._libc is not None and _mallinfo2() is not None

    def __call__(self) -> int:
        """The bytes the RSS fell by (0 when nothing was done)."""
        free = free_bytes()
        if self._libc is None or free is None or free <= self.min_free_bytes:
            return 0
        before, t0 = _rss_bytes(), time.perf_counter()
        self._libc.malloc_trim(ctypes.c_size_t(0))
        seconds, released = time.perf_counter() - t0, max(0, before - _rss_bytes())
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
    trimmer = Trimmer(settings.malloc_trim_min_free_bytes, on_trim)
    return PeriodicTask(trimmer, settings.malloc_trim_interval_s, "malloc-trim") if trimmer.available else None
