"""Two minutes of the soak test (benchmarks/soak.py): a mixed workload on SeaweedFS with faults.

Every check of the full run holds here too, but RSS: two minutes are mostly
warm-up, so only a leak far above allocator noise fails it (the full run,
30 minutes, holds the slope to 30 MiB/min).
"""

from __future__ import annotations

import pytest

from benchmarks.soak import FAULTS, Soak

pytestmark = pytest.mark.slow


def test_two_minutes_of_mixed_load_with_faults(tmp_path):
    report = Soak(duration_s=120, clients=3, fault_every_s=12, workdir=tmp_path, rss_slope_limit=300).run()
    summary = {k: report[k] for k in ("requests", "faults", "errors", "wrong_answers", "hung_requests", "checks")}
    assert report["ok"], (report["passed"], summary)
    assert set(report["faults"]) == set(FAULTS), summary  # every kind of fault was injected
    assert report["checked_pairs"] > 0 and report["requests"].get("stored_chat", 0) > 0, summary
    assert report["checks"]["gone_checked"] > 0, summary  # deletes and expiries really happened
