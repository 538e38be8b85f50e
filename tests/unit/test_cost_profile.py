"""What serving teaches the cost profile, and what it must not."""

from __future__ import annotations

import pytest

from scheduler.profile import RECEIVE_SMALL_BYTES, CostProfile

RAW = 11_796_510  # a lossless 256-token chunk of the default model


def profile() -> CostProfile:
    return CostProfile({"lossless": 2e-5}, 0.05, 1e-3, 0.0)


def test_small_objects_teach_the_overhead_and_large_ones_the_cost_per_byte():
    """As read from a local disk: ~1 ms per object whatever its size, 4 ms for a raw chunk."""
    p = profile()
    for _ in range(20):  # chunk tails
        p.observe_receive(126_000, 0.001)
    assert p.receive_s_per_object == pytest.approx(0.001) and p.receive_s_per_byte == 0.0
    p.observe_receive(RAW, 0.004)
    assert p.receive_s_per_byte == pytest.approx(0.003 / RAW)
    assert p.receive_seconds(RAW) == pytest.approx(0.004), "a raw chunk is priced as it was measured"
    assert p.receive_seconds(126_000) == pytest.approx(0.001 + 0.003 * 126_000 / RAW)
    assert p.receive_seconds(0) == 0.0  # nothing to fetch (the chunk is in memory)
    for _ in range(20):  # more tails never move the cost per byte
        p.observe_receive(RECEIVE_SMALL_BYTES - 1, 0.001)
    assert p.receive_seconds(RAW) == pytest.approx(0.004)


def test_the_profile_round_trips_through_json():
    p = profile()
    p.observe_receive(1000, 0.0005)
    p.observe_receive(2 * RECEIVE_SMALL_BYTES, 0.001)
    q = CostProfile.from_json(p.to_json())
    assert (q.receive_s_per_byte, q.receive_s_per_object) == (p.receive_s_per_byte, p.receive_s_per_object)
    assert q.decode_s_per_token == p.decode_s_per_token
