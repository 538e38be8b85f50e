"""What serving teaches the cost profile, and what it must not."""

from __future__ import annotations

import pytest

from scheduler.profile import RECEIVE_MIN_BYTES, CostProfile


def profile() -> CostProfile:
    return CostProfile({"lossless": 2e-5}, 0.05, 1e-3, 0.0)


def test_receive_cost_is_learned_per_byte_from_large_objects_only():
    p = profile()
    p.observe_receive(11_796_510, 0.004)  # a raw chunk read from a local disk: 4 ms of CPU
    assert p.receive_s_per_byte == pytest.approx(0.004 / 11_796_510)
    for _ in range(20):  # chunk tails: ~1 ms each, mostly the request's own overhead
        p.observe_receive(126_000, 0.001)
    assert p.receive_seconds(11_796_510) == pytest.approx(0.004), "small objects moved the per-byte cost"
    p.observe_receive(RECEIVE_MIN_BYTES, 0.002)
    assert p.receive_seconds(11_796_510) > 0.004


def test_the_profile_round_trips_through_json():
    p = profile()
    p.observe_receive(2 * RECEIVE_MIN_BYTES, 0.001)
    q = CostProfile.from_json(p.to_json())
    assert q.receive_s_per_byte == p.receive_s_per_byte and q.decode_s_per_token == p.decode_s_per_token
