"""The tc link (benchmarks/tc_link.py) as the fidelity benchmark runs it: in a network namespace of
its own, one SeaweedFS, boto3's connections through one shaped port. The check is that the link
shapes (a loopback moves GB/s) and shares its rate across the connections, not how close it holds
(that figure is the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.tc_link import available
from tests.gateway_process import REPO

pytestmark = pytest.mark.slow


@pytest.mark.skipif(available() is not None, reason=f"the tc link: {available()}")
def test_the_tc_link_shapes_all_connections_to_the_port_together(tmp_path):
    out = tmp_path / "fidelity.json"
    command = [sys.executable, "-m", "benchmarks.link_fidelity", "--links", "tc", "--rates", "80mbit",
               "--loads", "idle", "--seconds", "1.5", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (point,) = json.loads(out.read_text())["points"]
    assert point["link"] == "tc" and point["bytes"] > 0
    # 8 connections at once: one link's rate between them, not 8 x 80 Mbit/s, nor loopback speed
    assert 0.5 < point["ratio"] < 1.1, point
