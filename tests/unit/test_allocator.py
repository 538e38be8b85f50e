"""app/allocator.py: with the gateway's malloc settings, memory that threads allocate and free in
blocks of a few MiB (a step's activations) is reused without being faulted in again, and what
the threads freed goes back to the OS beyond a bound; with glibc's defaults each thread keeps its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.allocator import M_TRIM_THRESHOLD, SETTINGS, is_glibc
from app.malloc_trim import Trimmer, trim_task
from app.settings import Settings
from tests.gateway_process import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not is_glibc(), reason="glibc only")

PROBE = """
import resource, sys, threading
from pathlib import Path
import numpy as np

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

if sys.argv[1] == "tuned":
    from app.allocator import tune
    assert tune()

if sys.argv[2] == "pinned":  # freed blocks under live ones: the trim threshold cannot reach them
    import ctypes
    from app.malloc_trim import Trimmer

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    calls = []
    trimmer = Trimmer(64 << 20, on_trim=lambda released, seconds: calls.append(released))
    assert trimmer.available
    assert trimmer() == 0  # the first call only reads where the RSS starts
    before = rss_mib()
    kept = []

    def pin_freed_blocks():  # 60 blocks of 3 MiB, written, each under a kept one, then freed
        dropped = []
        for _ in range(60):
            block = libc.malloc(3 << 20)
            ctypes.memset(block, 1, 3 << 20)
            dropped.append(block)
            kept.append(libc.malloc(64 << 10))
        for block in dropped:
            libc.free(block)

    pin_freed_blocks()
    pinned = rss_mib()
    assert Trimmer(1 << 40)() == 0  # under its bound of growth: nothing is done
    released = trimmer() / 2**20
    assert calls and calls[-1] / 2**20 == released
    after = rss_mib()
    # the chunks stay free after their pages went back: with no new high since, no second trim
    assert trimmer() == 0 and len(calls) == 1
    # the same memory used again comes back up to the high mark only: a working set, left alone
    # (on free bytes alone, this would trim again)
    blocks = [libc.malloc(3 << 20) for _ in range(60)]
    for block in blocks:
        ctypes.memset(block, 1, 3 << 20)
    for block in blocks:
        libc.free(block)
    assert rss_mib() - after > 120, "the blocks were not faulted in again"
    assert trimmer() == 0 and len(calls) == 1
    rss_mib_after = after
    print(pinned - before, released, pinned - rss_mib_after)
    sys.exit(0)

if sys.argv[2] == "retained":
    before = rss_mib()

    def work():
        for _ in range(5):
            blocks = [np.ones(3 * 2**20 // 8) for _ in range(30)]  # 30 blocks of 3 MiB, written
            del blocks

    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(rss_mib() - before)
else:  # a model step's pattern: the same few blocks of a few MiB, allocated, written, freed
    def step():
        blocks = [np.ones(3 * 2**20 // 8) for _ in range(4)]
        del blocks

    step()
    before = faults()
    for _ in range(20):
        step()
    print((faults() - before) / 20)
"""


def run_probe(mode: str, what: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, what],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def probe(mode: str, what: str) -> float:
    return float(run_probe(mode, what))


def test_a_steps_blocks_are_reused_without_faulting_them_in_again():
    # 4 blocks of 3 MiB are 3,072 pages: a fixed 1 MiB mmap threshold (the setting before this
    # one) mapped each block afresh and faulted every page in again, every step
    assert probe("tuned", "faults") < 100


def test_freed_blocks_beyond_the_trim_threshold_go_back_to_the_os():
    # with glibc's defaults each of the 16 threads keeps what it freed in an arena of its own
    # (817-979 MiB in 8 runs); with the settings, the shared arenas keep a few trim thresholds'
    # worth, whatever the number of threads (181-276 MiB with 64 MiB; on a later machine 126-315,
    # and up to 543 while another process loaded the cores)
    trim_mib = dict(SETTINGS)[M_TRIM_THRESHOLD] / 2**20
    tuned, default = probe("tuned", "retained"), probe("glibc", "retained")
    assert tuned < 6 * trim_mib, f"{tuned:.0f} MiB still resident after everything was freed"
    assert default > 2 * tuned  # glibc's defaults keep them (the probe tells the two apart)


@pytest.mark.skipif(not Trimmer(0).available, reason="glibc 2.33's mallinfo2")
def test_the_trimmer_gives_back_freed_blocks_pinned_under_live_ones():
    # 60 freed blocks of 3 MiB, each under a small live one: the arena cannot shrink from its top,
    # so they stay resident until malloc_trim gives their pages back; then the trimmer waits for
    # the RSS to pass that high mark again
    pinned, released, fell = (float(v) for v in run_probe("tuned", "pinned").split())
    assert pinned > 150, f"only {pinned:.0f} of 180 MiB stayed resident once freed: nothing pinned them"
    assert released > 120, f"the trim gave back {released:.0f} of 180 MiB"
    assert fell > 120  # the probe's own reading agrees with the trimmer's


@pytest.mark.skipif(not Trimmer(0).available, reason="glibc 2.33's mallinfo2")
def test_the_gateways_trim_task_follows_its_settings():
    task = trim_task(Settings(malloc_trim_interval_s=0.25, malloc_trim_growth_bytes=100 << 20))
    assert task is not None and task.interval_s == 0.25
    assert isinstance(task.task, Trimmer) and task.task.growth_bytes == 100 << 20
    assert trim_task(Settings(malloc_trim_interval_s=0)) is None
    assert trim_task(Settings(malloc_tuning=False)) is None  # glibc's defaults: no trim either
