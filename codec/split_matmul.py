"""The transform's batched matmul on a CPU, split over the codec's share of the cores.

In the gateway, codec work runs on threads whose torch has one intra-op
thread: a second OpenMP team beside the model's makes every forward pass
slower (``app/threads.py``). So the inverse transform's bf16 ``bmm`` (60
groups of 256 x 192 x 192 for the default model) ran on one core, while
numba's integer decode before it used every core the codec gate gave the
operation. On 2 cores that was 5.4-5.8 ms of a ``medium`` chunk's 13.8.

``bmm`` here splits the groups over as many plain threads as numba's thread
count for the calling thread (the gate's share: every core while the model
idles, a quarter of them while it runs), each with one torch thread. On 2
cores: 2.9-3.0 ms, about one ``bmm`` on two OpenMP threads (2.7 ms), with no
second OpenMP team. The inverse gives each lane its groups' copy into bf16
too (``over_groups``). Where the caller's torch has more than one thread (tools,
tests), or off the CPU, it is one ``torch.bmm`` as before. Each group is one
``bmm`` row whichever thread runs it, so the result is the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numba
import torch

_lock = threading.Lock()
_helpers: ThreadPoolExecutor | None = None


def _one_torch_thread() -> None:
    torch.set_num_threads(1)


def _pool() -> ThreadPoolExecutor:
    global _helpers
    with _lock:
        if _helpers is None:
            workers = max(1, numba.config.NUMBA_NUM_THREADS - 1)  # the caller is a lane too
            _helpers = ThreadPoolExecutor(workers, "codec-matmul", initializer=_one_torch_thread)
        return _helpers


def lanes(groups: int, device: torch.device) -> int:
    """How many threads ``bmm`` splits ``groups`` groups over when called from this thread."""
    if device.type != "cpu" or torch.get_num_threads() > 1:
        return 1
    return max(1, min(groups, numba.get_num_threads()))  # numba's count never exceeds its pool


def over_groups(groups: int, device: torch.device, work: Callable[[int, int], object]) -> None:
    """``work(i, j)`` for the groups ``i:j`` of each of ``lanes`` slices, the first on this thread."""
    n = lanes(groups, device)
    if n == 1:
        work(0, groups)
        return
    cuts = [groups * i // n for i in range(n + 1)]
    pool = _pool()
    others = [pool.submit(work, i, j) for i, j in zip(cuts[1:-1], cuts[2:])]
    try:
        work(0, cuts[1])
    finally:
        wait(others)  # no lane outlives the call (it writes the caller's buffers), even on an error
    for other in others:
        other.result()


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b, out=out)``, its groups split over ``lanes`` threads."""
    over_groups(a.shape[0], a.device, lambda i, j: torch.bmm(a[i:j], b[i:j], out=out[i:j]))
    return out
