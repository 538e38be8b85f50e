"""Timing side channel (CVE-2025-46570): tenant B's TTFT does not tell whether tenant A stored a prefix."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.tenant_timing import KEY_A, KEY_B, measure, print_table, prompts
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow


def test_a_prefix_stored_by_another_tenant_times_like_one_nobody_stored(tmp_path, model_dir, tokenizer):
    stored, unstored = prompts(tokenizer)
    # the store's side channel, every trial from the store: the prefix cache would serve B's own
    # repeats from memory (salted per tenant too: tests/integration/test_gateway_prefix_cache.py)
    env = {
        "CACHEGEN_STORE": f"file://{tmp_path / 'store'}",
        "CACHEGEN_API_KEY": f"{KEY_A},{KEY_B}",
        "CACHEGEN_PREFIX_CACHE": "false",
    }
    with GatewayProcess(env, tmp_path / "gateway.log") as gw:
        created = httpx.post(
            f"{gw.url}/contexts",
            json={"prompt_token_ids": stored},
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=300,
        )
        assert created.status_code == 200, created.text
        result = measure(gw.url, stored, unstored, trials=50)
    print_table(result)
    arms = result["arms"]
    assert arms["b_on_a_stored"]["cached_tokens"] == [0] and arms["b_on_unstored"]["cached_tokens"] == [0]
    assert arms["a_on_a_stored"]["cached_tokens"] == [256]
    # the test can tell a hit from a miss when there is one...
    assert result["p_value_control_hit_vs_miss"] < 1e-6
    # ...and finds none between B's two arms (a false alarm at this level: 1 run in 1000)
    assert result["p_value_b_stored_vs_unstored"] > 1e-3
