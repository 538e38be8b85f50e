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


def test_a_short_tail_chunk_moves_the_decode_cost_by_its_share_of_a_chunk():
    """A load's 5-token tail decodes in about a call's fixed cost: learned at full weight, every
    load made the level look dearer (per token) than its whole chunks are."""
    whole = 0.011 / 256  # 11 ms a 256-token chunk
    p = CostProfile({"medium": whole}, 0.05, 1e-3, 0.0)
    for _ in range(20):
        for _ in range(16):
            p.observe_decode("medium", 256, 0.011, full_tokens=256)
        p.observe_decode("medium", 5, 0.0004, full_tokens=256)  # 20 ms a chunk, per token
    assert p.decode_seconds("medium", 256) == pytest.approx(0.011, rel=0.02)
    q = CostProfile({"medium": whole}, 0.05, 1e-3, 0.0)
    for _ in range(20):  # the same loads at full weight
        for _ in range(16):
            q.observe_decode("medium", 256, 0.011)
        q.observe_decode("medium", 5, 0.0004)
    assert q.decode_seconds("medium", 256) > 0.0115  # what the weight prevents
    p.observe_decode("medium", 256, 0.0055, full_tokens=256)  # a whole chunk counts fully
    assert p.decode_seconds("medium", 256) == pytest.approx(0.8 * 0.011 + 0.2 * 0.0055, rel=0.02)


def test_one_slow_decode_moves_the_estimate_a_little_and_a_slower_machine_is_learned():
    p = CostProfile({"medium": 0.020 / 256}, 0.05, 1e-3, 0.0)
    p.observe_decode("medium", 256, 0.140, full_tokens=256)  # a fresh process's first chunk
    assert p.decode_seconds("medium", 256) == pytest.approx(0.020 * 1.05)
    for _ in range(16):
        p.observe_decode("medium", 256, 0.020, full_tokens=256)
    assert p.decode_seconds("medium", 256) == pytest.approx(0.020, rel=0.01)
    for _ in range(40):  # the machine got 2x slower: a few loads' chunks teach it
        p.observe_decode("medium", 256, 0.040, full_tokens=256)
    assert p.decode_seconds("medium", 256) == pytest.approx(0.040, rel=0.02)
