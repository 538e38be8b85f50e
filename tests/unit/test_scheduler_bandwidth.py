"""The bandwidth estimator against transfers on a simulated shared link (real threads, real time)."""

from __future__ import annotations

import threading
import time

import pytest

from scheduler.bandwidth import BandwidthEstimator


def transfer(est: BandwidthEstimator, nbytes: int, seconds: float) -> None:
    started = est.begin()
    time.sleep(seconds)
    est.end(started, nbytes)


def parallel_round(est: BandwidthEstimator, n: int, nbytes: int, rate: float) -> None:
    """``n`` transfers sharing a link fairly: all finish together after n * nbytes / rate."""
    threads = [threading.Thread(target=transfer, args=(est, nbytes, n * nbytes / rate)) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_no_estimate_before_any_transfer():
    assert BandwidthEstimator().bytes_per_second is None


def test_concurrent_transfers_finishing_together_are_not_counted_as_a_burst():
    est = BandwidthEstimator()
    for _ in range(4):
        parallel_round(est, n=3, nbytes=100_000, rate=2e6)
    # the sleeps only ever overshoot, so the estimate may be low, never high
    assert 1.2e6 < est.bytes_per_second <= 2.05e6


def test_idle_time_between_transfers_does_not_count():
    est = BandwidthEstimator()
    for _ in range(3):
        transfer(est, 50_000, 0.025)  # 2 MB/s while busy
        time.sleep(0.05)
    assert est.bytes_per_second == pytest.approx(2e6, rel=0.4)


def test_follows_a_rate_change_within_a_window():
    est = BandwidthEstimator(window_s=0.1)
    for _ in range(5):
        transfer(est, 40_000, 0.02)  # 2 MB/s
    for _ in range(8):
        transfer(est, 4_000, 0.02)  # 0.2 MB/s
    assert est.bytes_per_second < 0.3e6


def test_a_bunch_finishing_after_a_long_shared_transfer_is_not_a_burst():
    """Five fetches share a 2.5 MB/s link for 0.8 s and finish within a few ms of each other."""
    est = BandwidthEstimator()
    start = est.begin()
    time.sleep(0.8)
    for _ in range(5):
        est.end(start, 400_000)
        time.sleep(0.002)
    assert est.bytes_per_second <= 2.6e6
