"""The KV buffers' memory on a CPU: one region, mapped and touched once, handed out in whole blocks.

A fresh ``torch.empty`` of a few MiB or more is a mapping of its own (glibc's
mmap threshold, ``app/allocator.py``), and its pages are faulted in one by one
as they are first written. On the 2-core test machine that cost 0.37 ms per MiB:
a 3.8K-token prefix's KV (175 MB) spent about 65 ms faulting on every load,
fresh process or not, and eight loads at once faulted on one process-wide lock.
Here every buffer is carved from one region sized by the KV memory budget:
its pages are faulted in once (at start-up with ``prefault``, else on their
first use), and a freed buffer's blocks are reused, already resident.

- **Blocks.** The region is cut into blocks of ``BLOCK_TOKENS`` tokens' KV,
  which is also the prefix cache's block (``scheduler.prefix_cache`` takes it
  from here), a divisor of the store's 256-token chunks. A buffer is a run of consecutive blocks,
  so it is one contiguous ``(layers, 2, kv_heads, tokens, head_dim)`` tensor,
  the layout every reader already takes; the codec decodes into it in place.
  A request reserves whole blocks from ``KVMemory`` (``ModelRunner.kv_bytes``),
  so a budget the reservations fit is a region the buffers fit, short of
  fragmentation.
- **Freed with the last view.** A buffer's blocks come back when the last
  tensor that views them is gone, not when its request ends: the prefix cache
  and other requests read buffers after their request has finished. The
  blocks' owner is a numpy view that the tensor's storage keeps alive; its
  finalizer queues the blocks, and the next allocation takes them back (a
  finalizer may run on any thread, in the middle of an allocation).
- **Misses.** When no run of free blocks is long enough, ``tensor`` returns
  None and the caller allocates as before; ``misses`` counts it.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import math
import mmap
import threading
import weakref
from collections import deque

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in, writable, without writing to it
_PREFAULT_STEP = 64 << 20


class KVPool:
    def __init__(self, nbytes: int, block_bytes: int, prefault: bool = True) -> None:
        if block_bytes <= 0 or block_bytes % 64:
            raise ValueError(f"a block must be a positive multiple of 64 bytes, got {block_bytes}")
        self.block_bytes = block_bytes
        self.blocks = max(1, math.ceil(nbytes / block_bytes))
        self._map = mmap.mmap(-1, self.blocks * block_bytes)
        self._arena = np.frombuffer(self._map, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, self.blocks)]  # (first block, count), by first block
        self._returned: deque[tuple[int, int]] = deque()  # freed runs the finalizers queued
        self._lock = threading.Lock()
        self.used_blocks = 0
        self.misses = 0  # allocations that found no run of free blocks long enough
        if prefault:
            self.prefault()

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._take_back()
            return self.used_blocks * self.block_bytes

    def blocks_for(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.block_bytes)

    def prefault(self) -> None:
        """Fault every page of the region in now, so no request pays for it later."""
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        libc = _libc()
        for start in range(0, self.nbytes, _PREFAULT_STEP):
            length = min(_PREFAULT_STEP, self.nbytes - start)
            if libc is None or libc.madvise(ctypes.c_void_p(address + start), length, _MADV_POPULATE_WRITE):
                self._arena[start : start + length] = 0  # older kernels: write the pages in
        log.debug("prefaulted %d MiB of KV memory", self.nbytes >> 20)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized contiguous tensor on the pool's blocks; None when no run fits."""
        nbytes = math.prod(shape) * dtype.itemsize
        owner = self._carve(nbytes)
        if owner is None:
            return None
        return torch.from_numpy(owner)[:nbytes].view(dtype).view(shape)  # its storage holds ``owner``

    def buffer(self, nbytes: int) -> memoryview | None:
        """``nbytes`` of writable memory on the pool's blocks (a fetched chunk's bytes are read into
        it: the staging memory a request reserves with its KV); None when no run fits."""
        owner = self._carve(nbytes)
        return None if owner is None else memoryview(owner)[:nbytes]  # the view holds ``owner``

    def _carve(self, nbytes: int) -> np.ndarray | None:
        """A uint8 array over the whole blocks that hold ``nbytes``, whose blocks come back when
        it is collected: what views it must keep this very object alive."""
        count = max(1, self.blocks_for(nbytes))
        with self._lock:
            self._take_back()
            first = self._take(count)
            if first is None:
                self.misses += 1
                return None
            self.used_blocks += count
        owner = self._arena[first * self.block_bytes : (first + count) * self.block_bytes]
        weakref.finalize(owner, self._returned.append, (first, count))
        return owner

    def _take(self, count: int) -> int | None:
        """The first block of the smallest free run of at least ``count`` blocks, taken out."""
        best = None
        for i, (first, length) in enumerate(self._free):
            if length >= count and (best is None or length < self._free[best][1]):
                best = i
                if length == count:
                    break
        if best is None:
            return None
        first, length = self._free[best]
        if length == count:
            del self._free[best]
        else:
            self._free[best] = (first + count, length - count)
        return first

    def _take_back(self) -> None:
        """Return the runs freed since the last call to the free list, merged with neighbours."""
        while self._returned:
            first, count = self._returned.popleft()
            self.used_blocks -= count
            i = bisect.bisect_left(self._free, (first, 0))
            if i < len(self._free) and first + count == self._free[i][0]:
                count += self._free[i][1]
                del self._free[i]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:
                first, count = self._free[i - 1][0], self._free[i - 1][1] + count
                del self._free[i - 1]
                i -= 1
            self._free.insert(i, (first, count))


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "madvise"):
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc
