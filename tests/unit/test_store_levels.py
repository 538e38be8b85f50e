"""The default stored levels: lossless only where loading it beats recomputing it."""

from __future__ import annotations

from codec import DEFAULT_LEVELS
from scheduler.profile import CostProfile
from scheduler.store_levels import default_store_levels

RAW_BYTES_PER_TOKEN = 46_080  # the default model's KV in fp32


def profile(prefill_s_per_token: float) -> CostProfile:
    decode = {lv.name: 1e-5 if lv.lossless else 1e-4 for lv in DEFAULT_LEVELS}
    return CostProfile(decode, 0.005, prefill_s_per_token, 0.0)


def test_a_slow_prefill_stores_lossless_and_a_fast_one_does_not():
    # 2 CPU cores: ~7 ms per token prefilled (4K tokens in 30 s); a raw 256-token chunk takes 94 ms at 1 Gbps
    cpu = default_store_levels(DEFAULT_LEVELS, profile(7e-3), 256, RAW_BYTES_PER_TOKEN)
    assert [lv.name for lv in cpu] == [lv.name for lv in DEFAULT_LEVELS]
    # a GPU: ~10 us per token
    gpu = default_store_levels(DEFAULT_LEVELS, profile(1e-5), 256, RAW_BYTES_PER_TOKEN // 2)
    assert [lv.name for lv in gpu] == [lv.name for lv in DEFAULT_LEVELS if not lv.lossless]
    assert gpu  # every lossy level is kept
