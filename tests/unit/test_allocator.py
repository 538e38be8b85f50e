"""app/allocator.py: with the gateway's malloc settings, memory that threads allocate and free in
blocks of a few MiB (KV chunks, activations) goes back to the OS; with glibc's defaults it stays."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.allocator import is_glibc
from tests.gateway_process import REPO

PROBE = """
import sys, threading
from pathlib import Path
import numpy as np

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

if sys.argv[1] == "tuned":
    from app.allocator import tune
    assert tune()
before = rss_mib()

def work():
    for _ in range(5):
        blocks = [np.ones(3 * 2**20 // 8) for _ in range(30)]  # 30 blocks of 3 MiB, written
        del blocks

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(rss_mib() - before)
"""


def retained_mib(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or not is_glibc(), reason="glibc only")
def test_freed_blocks_go_back_to_the_os_with_the_gateways_settings():
    tuned, default = retained_mib("tuned"), retained_mib("glibc")
    assert tuned < 16, f"{tuned:.0f} MiB still resident after everything was freed"
    assert default > tuned + 50  # glibc's defaults keep them (the probe tells the two apart)
