"""The C allocator's settings for a long-running server: bounded arenas, and activations reused, not faulted in.

torch's CPU tensors come from glibc's malloc. glibc's defaults suit short programs:
- every thread that allocates gets an arena of its own (up to 8 per core), and each arena keeps
  what its thread freed for that thread's next allocation;
- the mmap threshold rises each time a large block is freed, up to 32 MiB.

The gateway allocates on many threads: the model thread, prepare and encode pools, and S3 I/O.
Under 32 clients, its RSS therefore grew by what the arenas held on top of the KV budget
(``benchmarks/memory_bench.py``, docs/serving.md).

``tune()`` sets, through ``mallopt`` and before the server's threads exist:
- ``M_ARENA_MAX`` 2: threads share two arenas;
- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): a fixed value also turns the rise off. A block
  under it comes from an arena, and a freed one is reused, already resident;
- ``M_TRIM_THRESHOLD`` 64 MiB: an arena gives back the free memory at its top beyond that.

The mmap threshold was 1 MiB until the KV buffers moved to their own region (``engine/kv_pool.py``):
every block of 1 MiB or more was then a mapping of its own, unmapped when freed. A model step's
activations are such blocks, so every prefill step mapped them afresh and faulted their pages in
one by one: about 37,000 faults (150 MB) for a 256-token step. On the 2-core test machine that
step took 1.1-1.2 s instead of 0.41 s while a load ran beside it (the faults then cost 0.9 s of
kernel time), and a cold 3.8K-token prompt took 8.5-11.7 s instead of 5.2-5.8 s
(``benchmarks/vs_vllm.py --skip-vllm``, two alternating runs each:
``benchmarks/results/vs_vllm_skip_malloc_*.json``). An arena gives back the free memory at its
top beyond the trim threshold: in the unit test's probe, 16 threads that allocate and free 3 MiB
blocks leave 181-276 MiB resident, against 817-979 MiB with glibc's defaults.

Freed memory in the middle of an arena stays resident: the trim threshold only gives back its top,
so a long-lived block above freed ones pins them. ``app/malloc_trim.py`` gives such pages back.

Setting ``CACHEGEN_MALLOC_TUNING=false`` keeps glibc's defaults, and turns that trim off. Other C
libraries (musl, macOS) are left alone.
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

SETTINGS = ((M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))


def glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def is_glibc() -> bool:
    return glibc() is not None


def tune() -> bool:
    """Apply SETTINGS; False (and nothing changed) where the C library is not glibc."""
    libc = glibc()
    if libc is None:
        return False
    for param, value in SETTINGS:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("mallopt(%d, %d) was refused; keeping glibc's default for it", param, value)
    return True
