"""The model thread keeps the torch thread count the step loop asks for; a codec operation takes
every core only while the model is idle.

torch resets a thread's count, at its first parallel op, to the count last set by any thread: a
model thread whose first forward pass came after a prepare thread had set one thread ran every
step on one thread (scheduler/step_loop.py, ``_set_threads``). Run in a child process, so this
process's threads keep their own counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import threading, torch
    from scheduler.step_loop import StepLoop
    loop = StepLoop(runner=None, max_num_seqs=1, max_batched_tokens=1, torch_threads=lambda: 2)
    loop.call(lambda: None)  # start-up work on the model thread (a cost profile read from its file)
    # then a prepare thread sets its one thread, before the model thread's first forward pass
    t = threading.Thread(target=torch.set_num_threads, args=(1,)); t.start(); t.join()
    loop.call(lambda: torch.ones(1 << 20).sum())  # the model thread's first parallel op
    print(loop.call(torch.get_num_threads))
    loop.stop()
    """
)


def test_the_model_thread_keeps_its_thread_count():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "2", out.stderr


CODEC_CHILD = textwrap.dedent(
    """
    import threading, numba
    from app.threads import codec_threads, thread_budget
    from scheduler.codec_gate import CodecGate
    from scheduler.step_loop import StepLoop
    loop = StepLoop(runner=None, max_num_seqs=1, max_batched_tokens=1)
    gate = CodecGate(before=codec_threads(thread_budget(None, None, 2), loop.model_busy))
    seen = []

    def decode():  # a prepare thread's codec operation, as the loader runs it
        with gate:
            seen.append(numba.get_num_threads())

    def on_a_worker():
        t = threading.Thread(target=decode); t.start(); t.join()

    on_a_worker()  # the model has nothing to run
    release, started = threading.Event(), threading.Event()
    threading.Thread(target=loop.call, args=(lambda: (started.set(), release.wait()),)).start()
    started.wait()
    on_a_worker()  # the model thread is busy
    release.set()
    print(seen)
    loop.stop()
    """
)


def test_a_codec_operation_takes_every_core_only_while_the_model_is_idle():
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", CODEC_CHILD], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    assert out.stdout.strip() == "[2, 1]", out.stderr
