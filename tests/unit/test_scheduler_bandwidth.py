"""The bandwidth estimator against transfers on a simulated shared link (real threads, real time)."""

from __future__ import annotations

import threading
import time

import pytest

from scheduler.bandwidth import BandwidthEstimator, LinkRates


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


def level_transfer(rates: LinkRates, level: str, nbytes: int, seconds: float) -> None:
    started = rates.begin()
    time.sleep(seconds)
    rates.end(started, nbytes, level)


def test_each_level_gets_the_rate_of_its_own_transfers():
    """Small transfers pay a per-request cost that large ones spread over more bytes: each level
    is priced at what its own transfers got, not at the mix."""
    rates = LinkRates(evidence_s=0.0)
    for _ in range(3):
        level_transfer(rates, "medium", 20_000, 0.02)  # 1 MB/s
        level_transfer(rates, "lossless", 200_000, 0.02)  # 10 MB/s
    got = rates.for_levels(["lossless", "medium"], fallback=rates.bytes_per_second, floor=1.0)
    assert got["lossless"] == pytest.approx(10e6, rel=0.4)
    assert got["medium"] == pytest.approx(1e6, rel=0.4)
    assert got["medium"] < rates.bytes_per_second < got["lossless"]
    # a store with no floor (a link) plans every level at the overall estimate
    overall = rates.bytes_per_second
    assert rates.for_levels(["lossless", "medium"], fallback=overall) == {
        "lossless": overall,
        "medium": overall,
    }


def test_a_level_not_measured_gets_the_fallback_raised_to_the_floor():
    rates = LinkRates()
    level_transfer(rates, "medium", 20_000, 0.02)
    measured = rates.bytes_per_second
    # no floor (a remote link): the overall estimate, as before levels had rates of their own
    assert rates.for_levels(["lossless"], fallback=measured) == {"lossless": measured}
    # a store that claims a rate for large reads is tried at it before a small level's rate counts
    assert rates.for_levels(["lossless"], fallback=measured, floor=2e9) == {"lossless": 2e9}


def test_under_a_floor_a_level_counts_once_its_transfers_add_up_to_the_evidence():
    rates = LinkRates(evidence_s=0.05)
    level_transfer(rates, "lossless", 20_000, 0.02)  # 1 MB/s, on 20 ms of transfers
    assert rates.for_levels(["lossless"], fallback=1.0, floor=5e6) == {"lossless": 5e6}
    for _ in range(3):
        level_transfer(rates, "lossless", 20_000, 0.02)
    # a slow store says so: its own rate, below the floor, once it rests on enough transfers
    assert rates.for_levels(["lossless"], fallback=1.0, floor=5e6)["lossless"] == pytest.approx(1e6, rel=0.4)


def test_a_level_not_read_for_a_while_goes_back_to_the_fallback():
    """A level measured slow once (congestion) would never be planned, so never read, so never
    measured again: once others have been read for ``stale_s`` without it, it is priced as a level
    not measured yet."""
    rates = LinkRates(stale_s=0.1, evidence_s=0.0)
    level_transfer(rates, "lossless", 2_000, 0.02)  # 0.1 MB/s: a congested moment
    level_transfer(rates, "medium", 20_000, 0.02)  # 1 MB/s, right after
    assert rates.for_levels(["lossless"], fallback=5e6, floor=1.0)["lossless"] == pytest.approx(
        0.1e6, rel=0.4
    )
    time.sleep(0.12)
    level_transfer(rates, "medium", 20_000, 0.02)
    assert rates.for_levels(["lossless"], fallback=5e6, floor=1.0) == {"lossless": 5e6}
    assert rates.for_levels(["medium"], fallback=5e6, floor=1.0)["medium"] == pytest.approx(1e6, rel=0.4)


def test_under_a_floor_enough_transfers_count_however_short():
    """Small reads add up to little transfer time: a few of them are evidence too."""
    rates = LinkRates(evidence_s=1.0, evidence_transfers=3)
    for _ in range(2):
        level_transfer(rates, "medium", 5_000, 0.005)  # 1 MB/s
    assert rates.for_levels(["medium"], fallback=1.0, floor=5e6) == {"medium": 5e6}
    level_transfer(rates, "medium", 5_000, 0.005)
    assert rates.for_levels(["medium"], fallback=1.0, floor=5e6)["medium"] == pytest.approx(1e6, rel=0.5)
