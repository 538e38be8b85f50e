"""The C allocator's settings for a long-running server, so that freed memory goes back to the OS.

torch's CPU tensors come from glibc's malloc. glibc's defaults suit short programs:
- every thread that allocates gets an arena of its own (up to 8 per core), and each arena keeps
  what its thread freed for that thread's next allocation;
- the mmap threshold rises each time a large block is freed, up to 32 MiB. After that, a KV buffer,
  a decoded chunk or a prefill's activations of a few MiB come from an arena, not from a mapping
  of their own that ``free`` would unmap.

The gateway allocates on many threads: the model thread, prepare and encode pools, and S3 I/O.
Under 32 clients, its RSS therefore grew by what the arenas held on top of the KV budget
(``benchmarks/memory_bench.py``, docs/serving.md).

``tune()`` sets, through ``mallopt`` and before the server's threads exist:
- ``M_ARENA_MAX`` 2: threads share two arenas;
- ``M_MMAP_THRESHOLD`` 1 MiB: a fixed value also turns the rise off, so every block of 1 MiB or more
  is a mapping of its own, returned when freed;
- ``M_TRIM_THRESHOLD`` 32 MiB: the main heap gives back free memory at its top beyond that.

Setting ``CACHEGEN_MALLOC_TUNING=false`` keeps glibc's defaults. Other C libraries (musl, macOS)
are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

SETTINGS = ((M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 1 << 20), (M_TRIM_THRESHOLD, 32 << 20))


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def is_glibc() -> bool:
    return _glibc() is not None


def tune() -> bool:
    """Apply SETTINGS; False (and nothing changed) where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    for param, value in SETTINGS:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("mallopt(%d, %d) was refused; keeping glibc's default for it", param, value)
    return True
