"""The thread budget: torch's intra-op threads and numba's codec threads share the machine's cores.

The step loop's forward passes run on torch's OpenMP threads; decoding a
stored prefix (prepare threads), encoding a pre-encode or a write-back run on
numba's. They run at the same time, so together they get no more threads than
there are cores: an OpenMP team that loses one of its cores to another thread
waits at every barrier. Measured on 2 cores (``benchmarks/thread_budget.py``):
a batch-8 decode step took 81 ms with 2 torch threads and 94 ms with 1 on an
idle machine, but 265 ms against 115 ms while a chunk decoded beside it, and
250 ms against 142-177 ms with the cores shared with other processes (3.8 s
against 0.23 s for both at once). So by default numba gets a quarter of the
cores (at least one) and torch the rest (at least one): on 2 cores, one each.
While no codec work runs, torch may use every core (``torch_alone``): the step
loop switches before each step (``scheduler/codec_gate.py``). That keeps the
idle machine's speed (2 threads: 1.8x faster prefill, 15% faster decode
steps on 2 cores) without paying for it when a decode runs beside a step.
The codec's side is the mirror image (``numba_alone``): a decode or an encode
that starts while the model has nothing to run takes every core, so one
stored prefix loading into an idle gateway is not decoded on half the machine.

Only the model thread runs torch with more than one thread. GNU OpenMP keeps
a team of worker threads for every thread that ever ran a parallel region,
and once it manages more threads than there are cores it stops spinning
between regions and puts its workers to sleep: every parallel region then
pays for waking them. Measured on 2 cores, a batch-4 decode step on the
model thread went from 62 ms to 89-95 ms for the rest of the process's life
after another thread had run one 2K-token prefill with two threads (and to
98 ms with ``OMP_WAIT_POLICY=PASSIVE``, the same effect made permanent). So
every other thread (start-up, the event loop, prepare and write-back pools)
runs torch on one thread, and start-up work that needs the model's speed
(the cost profile) runs on the model thread. The codec's one torch operation
of weight, the transform's matmul, is split over plain threads instead, as
many as numba's share (``codec/split_matmul.py``).

numba's thread count is per calling thread too, so the pools set both in
their initializer (``worker_initializer``).

numba's threading layer (``use_codec_layer``): TBB where it loads, else
numba's own workqueue, never its default OpenMP layer (see
``configure_threads``). With workqueue a codec worker was often late to a
parallel region, so the region ran at one thread's speed: in the gateway a
``medium`` chunk decoded in 12.5 ms (median), against 9.3 ms with TBB
(``benchmarks/gateway_decode.py``, docs/serving.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadBudget:
    torch: int  # while codec work runs beside the model
    numba: int
    torch_alone: int  # while it does not
    numba_alone: int  # for a codec operation that starts while the model has nothing to run


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_budget(
    torch_threads: int | None, numba_threads: int | None, cores: int | None = None
) -> ThreadBudget:
    """Settings win; unset ones split ``cores`` (default: this process's) as described above."""
    cores = cores or available_cores()
    numba = numba_threads or max(1, cores // 4)
    torch = torch_threads or max(1, cores - numba)
    return ThreadBudget(
        torch=torch, numba=numba, torch_alone=torch_threads or cores, numba_alone=numba_threads or cores
    )


CODEC_LAYERS = ("auto", "tbb", "workqueue")


def use_codec_layer(layer: str = "auto") -> None:
    """numba's threading layer, before its first parallel kernel: ``auto`` is TBB where it loads
    (the ``tbb`` package), else workqueue; OpenMP is never tried."""
    import numba

    if layer not in CODEC_LAYERS:
        raise ValueError(f"codec threading layer {layer!r} is not one of {CODEC_LAYERS}")
    numba.config.THREADING_LAYER_PRIORITY = ["tbb", "workqueue", "omp"]  # workqueue always loads
    numba.config.THREADING_LAYER = "default" if layer == "auto" else layer


def configure_threads(budget: ThreadBudget, model_thread: bool = False, codec_layer: str = "auto") -> None:
    """Apply ``budget`` to the calling thread; call before torch or numba runs.

    The gateway's main thread is not the model thread: it gets one torch thread
    (see above). A tool that runs the model on the calling thread passes
    ``model_thread=True``.

    numba's default OpenMP layer, once started in a process that also runs
    torch, made every later torch forward pass 5-6x slower here (two OpenMP
    runtimes spinning against each other); TBB and numba's own ``workqueue``
    do not (``use_codec_layer``).
    """
    import torch

    use_codec_layer(codec_layer)
    torch.set_num_threads(budget.torch_alone if model_thread else 1)
    worker_initializer(budget)()
    if model_thread:
        torch.set_num_threads(budget.torch_alone)


BACKGROUND_NICE = 10


def lower_priority(nice: int = BACKGROUND_NICE) -> None:
    """Put the calling thread in Linux's SCHED_IDLE class (else raise its nice value), so that it
    runs on what the model thread's torch threads leave idle: a CPU-bound thread at equal
    priority takes a core from one of them, and the other then spins at every barrier of every
    op. Linux schedules threads on their own. Elsewhere, or where it is not allowed, nothing
    changes."""
    import os
    import threading

    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError):
            pass


def set_codec_threads(count: int) -> None:
    """Give the calling thread's next numba kernels ``count`` threads (at most numba's pool)."""
    import numba

    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))


def codec_threads(budget: ThreadBudget, model_busy: Callable[[], bool]) -> Callable[[], None]:
    """The codec gate's ``before`` (``scheduler/codec_gate.py``): the operation about to run gets
    every core the budget allows while the model has nothing to run, and its share while it has."""
    return lambda: set_codec_threads(budget.numba if model_busy() else budget.numba_alone)


def worker_initializer(budget: ThreadBudget) -> Callable[[], None]:
    """For ``ThreadPoolExecutor(initializer=...)``: one torch thread, the budget's numba threads."""

    def init() -> None:
        import torch

        torch.set_num_threads(1)
        set_codec_threads(budget.numba)

    return init
